#!/usr/bin/env python3
"""Quality, speed and memory of quantized SmolLM2-135M-Instruct, every variant served the same
way (one tritonserver, greedy over gRPC), against the unquantized f32 model:

- fixture ids: 32 greedy ids on each of three prompts (a chat question, plain text, a number to
  repeat back), counted equal to the unquantized model's;
- perplexity over the first 480 tokens of an English text that ships with Python
  (pydoc_data.topics["execmodel"], "Execution model"), fed one decode step at a time, and top-1
  agreement with the unquantized model at each of the 479 positions;
- decode ms per step (medians of the rounds, variants interleaved, each round a unique prompt,
  a warm-up round not counted) and weight bytes, for f32, bf16, int8 and fp8 weights.

Variants: f32, bf16, int8 and fp8 weights (f32 KV), int8 with the head (the tied embedding table)
quantized too (--quant-head), fp8 KV pools (f32 weights), and the negative
control: int8 whose codes are taken along the input axis while the scales stay per output
channel (a quantizer bug), which must fail the fixture check and blow the perplexity up.

    .venv/bin/python scripts/quant_checks.py [--rounds 4] [--json OUT.json] [--only f32,int8,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.export import writer as export  # noqa: E402
from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.frontends.client import TlalocClient, new_sequence_id  # noqa: E402
from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.export.quant import quantize_rows  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402

VARIANTS = {  # name -> export options beyond the common ones
    "f32": {},
    "bf16": {"weight_dtype": "bf16"},
    "int8": {"weight_quant": "int8"},
    "int8_head": {"weight_quant": "int8", "quant_head": True},
    "fp8": {"weight_quant": "fp8"},
    "fp8_kv": {"kv_dtype": "fp8"},
    "int8_wrong_axis": {"weight_quant": "int8"},
}
SPEED = ("f32", "bf16", "int8", "int8_head", "fp8")
TEXT_TOKENS = 480
FIXTURE_IDS = 32
SPEED_TOKENS = 32
QUESTIONS = ["Tell me about the history of the bicycle.", "Explain how rain forms.",
             "Describe a day at a busy market.", "What makes a good cup of tea?",
             "How do bees make honey?", "Why do leaves change color?"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wrong_axis_quantizer(w, quant):
    """The quantizer bug of the negative control: codes taken along the input axis (a scale per
    input column) while the stored scales stay per output channel."""
    return quantize_rows(w.T, quant)[0].T, quantize_rows(w, quant)[1]


def build(work: Path) -> dict[str, Path]:
    gguf = smollm2_gguf_path()
    # One context of 512 (the text's 480 tokens fit); prompts of up to 64 tokens prefill in the
    # 64-token entry.
    common = dict(batch_ladder=(1,), context_ladder=(512,), prefill_tokens=(64,))
    arts = {}
    for name, extra in VARIANTS.items():
        out = work / f"art-{name}"
        if name == "int8_wrong_axis":
            right = export.quantize_rows
            export.quantize_rows = wrong_axis_quantizer
            try:
                arts[name] = export_artifact(gguf, out, ExportOptions(**common, **extra))
            finally:
                export.quantize_rows = right
        else:
            arts[name] = export_artifact(gguf, out, ExportOptions(**common, **extra))
    return arts


def fixture_prompts(tok: ArtifactTokenizer) -> dict[str, list[int]]:
    return {
        "chat": tok.apply_chat_template([{"role": "user",
                                          "content": "What is the capital of France?"}]),
        "text": tok.encode("The history of the bicycle begins in the early nineteenth century,"),
        "number": tok.apply_chat_template([{"role": "user", "content":
                                            "Repeat this number exactly: 4719. What number?"}]),
    }


def text_ids(tok: ArtifactTokenizer) -> list[int]:
    from pydoc_data.topics import topics

    ids = tok.encode(topics["execmodel"])
    assert len(ids) >= TEXT_TOKENS, len(ids)
    return ids[:TEXT_TOKENS]


def score_text(client: TlalocClient, ids: list[int]) -> tuple[float, list[int]]:
    """Perplexity of ids[1:] given the tokens before each, fed one decode step at a time, and
    the argmax at each position."""
    sid = new_sequence_id()
    nll, argmax = [], []
    logits, _ = client.infer(sid, ids[:1], start=True)
    try:
        for nxt in ids[1:]:
            z = logits.astype(np.float64)
            m = z.max()
            nll.append(m + np.log(np.exp(z - m).sum()) - z[nxt])
            argmax.append(int(np.argmax(z)))
            logits, _ = client.infer(sid, [nxt])
    finally:
        client.infer(sid, [], end=True)
    return float(np.exp(np.mean(nll))), argmax


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="speed rounds (the first is a warm-up)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default=None, help="a comma-separated subset of the variants "
                    "(f32 is always served: the baseline)")
    args = ap.parse_args()
    if args.only:
        keep = {"f32", *args.only.split(",")}
        for name in [n for n in VARIANTS if n not in keep]:
            del VARIANTS[name]
    work = args.work or Path(tempfile.mkdtemp(prefix="tlaloc-quant-"))
    t_start = time.perf_counter()
    arts = build(work)
    tok = ArtifactTokenizer(arts["f32"] / "tokenizer")
    prompts = fixture_prompts(tok)
    text = text_ids(tok)
    repo = work / "repo"
    for name, art in arts.items():
        write_repository(art, repo, name, RepositoryOptions())
    server = TritonServer(repo, log_path=work / "tritonserver.log", exit_timeout_s=3)
    log(f"starting tritonserver with {len(arts)} models (log {server.log_path}) ...")
    server.start()
    results = {name: {} for name in arts}
    try:
        for name in arts:  # quality: each variant the same way
            with TlalocClient(server.grpc_url, name, "grpc") as c:
                results[name]["ids"] = {k: c.generate_greedy(p, FIXTURE_IDS).generated_ids
                                        for k, p in prompts.items()}
                t0 = time.perf_counter()
                results[name]["ppl"], results[name]["argmax"] = score_text(c, text)
                log(f"{name}: perplexity {results[name]['ppl']:.4f} "
                    f"({time.perf_counter() - t0:.1f} s)")
        speeds = [name for name in SPEED if name in arts]
        speed = {name: [] for name in speeds}
        for r in range(args.rounds):  # speed: interleaved, a unique prompt per round
            question = QUESTIONS[r % len(QUESTIONS)]
            ids = tok.apply_chat_template([{"role": "user", "content": question}])
            for name in speeds:
                with TlalocClient(server.grpc_url, name, "grpc") as c:
                    g = c.generate_greedy(ids, SPEED_TOKENS)
                if r > 0:
                    speed[name].append(g.ms_per_token)
    finally:
        server.stop()

    base = results["f32"]
    rows = []
    for name, res in results.items():
        art = load_artifact(arts[name])
        equal = sum(a == b for k in prompts for a, b in zip(res["ids"][k], base["ids"][k]))
        agree = sum(a == b for a, b in zip(res["argmax"], base["argmax"]))
        row = {"variant": name, "weight_bytes": sum(w.byte_length for w in art.weights),
               "kv_dtype": art.model.kv_dtype, "fixture_equal": equal,
               "fixture_total": FIXTURE_IDS * len(prompts), "ppl": res["ppl"],
               "ppl_change": res["ppl"] / base["ppl"] - 1, "top1_agree": agree,
               "top1_total": len(base["argmax"]),
               "answers": {k: tok.decode(v) for k, v in res["ids"].items()}}
        if name in speeds:
            row["ms_per_step"] = statistics.median(speed[name])
        rows.append(row)
    print(f"SmolLM2-135M-Instruct, {TEXT_TOKENS} tokens of pydoc_data.topics['execmodel'] "
          f"(Python {sys.version.split()[0]}); served by one tritonserver, gRPC; "
          f"{time.perf_counter() - t_start:.0f} s in all")
    print("| variant | weights MiB | KV | fixture ids equal to f32 | perplexity | change | "
          "top-1 agreement | decode ms/step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        ms = f"{row['ms_per_step']:.2f}" if "ms_per_step" in row else "-"
        print(f"| {row['variant']} | {row['weight_bytes'] / 2**20:.1f} | {row['kv_dtype']} | "
              f"{row['fixture_equal']} of {row['fixture_total']} | {row['ppl']:.4f} | "
              f"{row['ppl_change'] * 100:+.2f}% | {row['top1_agree']} of {row['top1_total']} "
              f"({row['top1_agree'] / row['top1_total'] * 100:.1f}%) | {ms} |")
    f32_ms = next(r["ms_per_step"] for r in rows if r["variant"] == "f32")
    for row in rows:
        if "ms_per_step" in row:
            print(f"{row['variant']}: decode {row['ms_per_step'] / f32_ms:.2f}x f32's time, "
                  f"weights {row['weight_bytes'] / rows[0]['weight_bytes']:.2f}x f32's bytes")
    for row in rows:
        print(f"{row['variant']}: {row['answers']['chat'][:60]!r}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = next((r for r in rows if r["variant"] == "int8_wrong_axis"), None)
    if bad is None:
        return 0
    ok = bad["fixture_equal"] < bad["fixture_total"] // 2 and bad["ppl_change"] > 1.0
    print(f"negative control (wrong-axis int8): {'fails the checks, as it must' if ok else 'PASSES: the checks cannot tell'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

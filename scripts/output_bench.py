#!/usr/bin/env python3
"""What the small outputs save: SmolLM2-135M-Instruct (f32) served by one tritonserver, 32 greedy
steps chosen from each step's LOGITS (the whole vocabulary, 196 KiB), from ARGMAX (4 bytes), and
from TOP_K_IDS + TOP_K_LOGPROBS (K = 8, 64 bytes), over gRPC and HTTP. Interleaved, a unique
chat prompt per round, the first round a warm-up; medians over the counted rounds of each run's
median step. Bytes are the outputs' payload per step.

    .venv/bin/python scripts/output_bench.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.frontends.client import TlalocClient, new_sequence_id  # noqa: E402
from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402

STEPS = 32
VARIANTS = {"LOGITS": ("LOGITS",), "ARGMAX": ("ARGMAX",),
            "TOP_K (8)": ("TOP_K_IDS", "TOP_K_LOGPROBS")}
QUESTIONS = ["Tell me about the history of the bicycle.", "Explain how rain forms.",
             "Describe a day at a busy market.", "What makes a good cup of tea?",
             "How do bees make honey?", "Why do leaves change color?"]


def run(client: TlalocClient, prompt: list[int], outputs) -> tuple[float, int, list[int]]:
    """(median ms a step, output bytes a step, greedy ids)."""
    sid = new_sequence_id()
    out = client.request(sid, prompt, start=True, outputs=outputs)
    ids, ms, nbytes = [], [], 0
    for _ in range(STEPS):
        if "ARGMAX" in out:
            ids.append(int(out["ARGMAX"][0]))
        elif "LOGITS" in out:
            ids.append(int(np.argmax(out["LOGITS"])))
        else:
            ids.append(int(out["TOP_K_IDS"][0]))
        t0 = time.perf_counter()
        out = client.request(sid, [ids[-1]], outputs=outputs)
        ms.append((time.perf_counter() - t0) * 1e3)
        nbytes = sum(a.nbytes for a in out.values())
    client.infer(sid, [], end=True)
    return statistics.median(ms), nbytes, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tlaloc-outputs-"))
    art = export_artifact(smollm2_gguf_path(), work / "art", ExportOptions(
        batch_ladder=(1,), context_ladder=(256,), prefill_tokens=(64,)))
    tok = ArtifactTokenizer(art / "tokenizer")
    write_repository(art, work / "repo", "smollm2", RepositoryOptions())
    server = TritonServer(work / "repo", exit_timeout_s=3).start()
    results = {(p, v): [] for p in ("grpc", "http") for v in VARIANTS}
    sizes, same = {}, True
    try:
        for r in range(args.rounds):
            prompt = tok.apply_chat_template([{"role": "user",
                                               "content": QUESTIONS[r % len(QUESTIONS)]}])
            for protocol in ("grpc", "http"):
                url = server.grpc_url if protocol == "grpc" else server.http_url
                with TlalocClient(url, "smollm2", protocol) as c:
                    ids = {}
                    for name, outputs in VARIANTS.items():
                        ms, nbytes, ids[name] = run(c, prompt, outputs)
                        sizes[name] = nbytes
                        if r > 0:
                            results[(protocol, name)].append(ms)
                    same &= len({tuple(v) for v in ids.values()}) == 1
    finally:
        server.stop()
    print(f"SmolLM2-135M-Instruct f32, {STEPS} greedy steps, {args.rounds - 1} counted rounds, "
          f"one sequence")
    print("| protocol | outputs | bytes a step | client ms a step | vs LOGITS |")
    print("|---|---|---:|---:|---:|")
    for protocol in ("grpc", "http"):
        base = statistics.median(results[(protocol, "LOGITS")])
        for name in VARIANTS:
            ms = statistics.median(results[(protocol, name)])
            print(f"| {protocol} | {name} | {sizes[name]:,} | {ms:.2f} | {ms - base:+.2f} ms |")
    print(f"greedy ids the same through every output: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

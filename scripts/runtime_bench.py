#!/usr/bin/env python3
"""The side-by-side benchmark: printed ratios measured in one run.

1. The compile cache: a second load of SmolLM2 against the first (fresh cache).
2. SmolLM2-135M-Instruct decode, ms per token, f32 and bf16 weights, each three ways: through
   Triton (a real tritonserver serving both artifacts, greedy over gRPC with `tlaloc generate`),
   through `tlaloc run` (no server), and transformers' generate on the same checkpoint (the
   GGUF, dequantized); against the floor: the bytes a step reads over a read bandwidth measured
   in this run. The prompt's prefill time and tokens/s the same three ways.
3. The decode executable alone at 1 row and at 4 rows.

Method: each measurement runs in its own process (warmed up first: transformers by a 2-token
generate, `tlaloc run` by one untimed 2-token generation, the server by the warm-up round), the
six decode configurations in turn, for several rounds (changing one thing at a time); each round has a unique prompt; the first round
is a warm-up and is not counted; a figure is the median over the counted rounds of the median
step in each. Run it on an otherwise idle machine:

    .venv/bin/python scripts/runtime_bench.py [--tokens 32] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Tell me about the history of the bicycle.", "Explain how rain forms.",
             "Describe a day at a busy market.", "What makes a good cup of tea?",
             "Write a short story about a lighthouse keeper.", "How do bees make honey?",
             "Describe the planets of the solar system.", "Why do leaves change color?"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_bandwidth() -> dict:
    """Read bandwidth: a sum over 512 MiB of f32, with numpy and with XLA; the faster counts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.ones(128 * 2**20, np.float32)
    nbytes = a.nbytes
    out = {}
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    out["numpy_gbps"] = nbytes / statistics.median(times[2:]) / 1e9
    d = jax.device_put(a)
    f = jax.jit(jnp.sum)
    f(d).block_until_ready()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        f(d).block_until_ready()
        times.append(time.perf_counter() - t0)
    out["xla_gbps"] = nbytes / statistics.median(times[2:]) / 1e9
    out["read_gbps"] = max(out["numpy_gbps"], out["xla_gbps"])
    return out


def step_bytes(artifact: Path) -> int:
    """Bytes a decode step reads: every weight once, except that an untied embedding table is
    read one row at a time (a tied one is read whole, as the head)."""
    m = json.loads((artifact / "tlaloc-serving.json").read_text())
    total = sum(w["byteLength"] for w in m["weights"])
    if not m["model"].get("tieWordEmbeddings", False):
        embed = next(w for w in m["weights"] if w["slot"] == "embed")
        total -= embed["byteLength"] - embed["byteLength"] // embed["shape"][0]
    return total


def compile_cache_ratio(artifact: Path) -> dict:
    from triton_tlaloc.runtime.core import Runtime

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        first = Runtime(artifact, cache_dir=Path(cache))
        t_first = time.perf_counter() - t0
        compile_s = first.compile_stats.seconds
        del first
        t0 = time.perf_counter()
        second = Runtime(artifact, cache_dir=Path(cache))
        t_second = time.perf_counter() - t0
        assert second.compile_stats.compiled == 0
        return {"first_load_s": t_first, "first_compile_s": compile_s,
                "second_load_s": t_second, "second_compile_s": second.compile_stats.seconds,
                "entries": len(second.executables)}


def rows_ratio(artifact: Path, context: int, rows: int = 4) -> dict:
    """The decode executable alone, 1 row against `rows` rows: runs alternate between the two
    (this machine's speed drifts), medians of 20 runs each."""
    from triton_tlaloc.runtime.core import Runtime
    from triton_tlaloc.engine.steps import Row, build_step

    names = [f"decode_b1_c{context}", f"decode_b{rows}_c{context}"]
    rt = Runtime(artifact, entries=names)
    bs = rt.artifact.model.block_size
    steps = {}
    for name, b in zip(names, (1, rows)):
        steps[b] = (name, build_step(rt.artifact.entries[name],
                                     [Row((5,), 40, tuple(range(1 + 4 * r, 5 + 4 * r)))
                                      for r in range(b)], bs))
        for _ in range(3):
            rt.run(*steps[b])
    times: dict = {1: [], rows: []}
    for _ in range(20):
        for b in (1, rows):
            t0 = time.perf_counter()
            rt.run(*steps[b])
            times[b].append(time.perf_counter() - t0)
    out = {b: statistics.median(t) * 1e3 for b, t in times.items()}
    return {"one_row_ms": out[1], f"{rows}_rows_ms": out[rows], "ratio": out[rows] / out[1]}


def run_tlaloc(artifact: Path, question: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(artifact),
                           "--chat", "--prompt", question, "--max-new-tokens", str(tokens + 1),
                           "--ignore-eos", "--json", "--warmup-runs", "1"],
                          capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    return {"ms_per_token": out["ms_per_token"], "prefill_ms": out["prefill_ms"],
            "prompt_tokens": len(out["prompt_ids"])}


def run_triton(url: str, model: str, question: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "generate", "--url", url,
                           "--protocol", "grpc", "--model", model, "--chat", "--prompt", question,
                           "--max-new-tokens", str(tokens + 1), "--ignore-eos", "--json"],
                          capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    return {"ms_per_token": out["ms_per_token"], "prefill_ms": out["prefill_ms"],
            "prompt_tokens": len(out["prompt_ids"])}


def hf_worker(gguf: str, dtype: str, question: str, tokens: int) -> None:
    """In a child process: transformers' greedy generate; ms per token from the difference
    between a (tokens + 1)-token generate and a 1-token one (which is the prefill)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch_dtype).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **kw)
        tn = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == tokens + 1
    print(json.dumps({"ms_per_token": (tn - t1) / tokens * 1e3, "prefill_ms": t1 * 1e3,
                      "prompt_tokens": int(ids.shape[1])}))


def run_hf(gguf: Path, dtype: str, question: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--hf-worker", str(gguf), dtype, question,
                           str(tokens)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the first a warm-up")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--hf-worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:
        gguf, dtype, question, tokens = args.hf_worker
        hf_worker(gguf, dtype, question, int(tokens))
        return 0

    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path
    from triton_tlaloc.export import ExportOptions, export_artifact

    gguf = smollm2_gguf_path()
    arts = {}
    for dtype in ("f32", "bf16"):
        out = args.out / f"smollm2-{dtype}-c{args.context}-b14"
        if not (out / "tlaloc-serving.json").is_file():
            t0 = time.perf_counter()
            export_artifact(gguf, out, ExportOptions(batch_ladder=(1, 4),
                                                     context_ladder=(args.context,),
                                                     weight_dtype=dtype))
            log(f"exported {out} in {time.perf_counter() - t0:.1f} s")
        arts[dtype] = out

    log("compile cache: first load against second ...")
    cache = compile_cache_ratio(arts["f32"])
    log("read bandwidth ...")
    bw = measure_bandwidth()
    log("1 row against 4 rows ...")
    rows = {dtype: rows_ratio(arts[dtype], args.context) for dtype in ("f32", "bf16")}

    from triton_tlaloc.repository import write_repository
    from triton_tlaloc.triton.server import TritonServer

    configs = [(path, dtype) for dtype in ("f32", "bf16")
               for path in ("triton", "tlaloc run", "transformers")]
    samples: dict = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("f32", "bf16"):
            write_repository(arts[dtype], Path(tmp) / "repo", f"smollm2-{dtype}")
        with TritonServer(Path(tmp) / "repo", log_path=args.out / "tritonserver.log") as server:
            log(f"tritonserver up at {server.grpc_url} (log {server.log_path})")
            for r in range(args.rounds):
                for c in configs:
                    question = QUESTIONS[(r * len(configs) + configs.index(c)) % len(QUESTIONS)]
                    question = f"{question} (round {r})"  # unique prompts
                    path, dtype = c
                    if path == "triton":
                        res = run_triton(server.grpc_url, f"smollm2-{dtype}", question,
                                         args.tokens)
                    elif path == "tlaloc run":
                        res = run_tlaloc(arts[dtype], question, args.tokens)
                    else:
                        res = run_hf(gguf, dtype, question, args.tokens)
                    log(f"round {r}{' (warm-up)' if r == 0 else ''}: {path} {dtype}: "
                        f"{res['ms_per_token']:.2f} ms/token, prompt of {res['prompt_tokens']} "
                        f"tokens {res['prefill_ms']:.1f} ms")
                    if r > 0 or args.rounds == 1:
                        samples[c].append(res)

    result = {"cache": cache, "bandwidth": bw, "tokens": args.tokens, "rounds": args.rounds,
              "decode": {}, "rows": rows}
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantized), decode of {args.tokens} tokens, "
          f"medians of {max(1, args.rounds - 1)} rounds; read bandwidth {bw['read_gbps']:.1f} GB/s "
          f"(numpy {bw['numpy_gbps']:.1f}, XLA {bw['xla_gbps']:.1f})\n")
    print(f"{'path':<14}{'weights':<9}{'ms/token':>10}{'floor ms':>10}{'x floor':>9}"
          f"{'tok/s vs HF':>13}{'prompt':>8}{'prefill ms':>12}{'prefill tok/s':>15}"
          f"{'vs HF':>8}")
    for path, dtype in configs:
        mine = samples[(path, dtype)]
        ms = statistics.median(s["ms_per_token"] for s in mine)
        pre = statistics.median(s["prefill_ms"] for s in mine)
        prompt = statistics.median(s["prompt_tokens"] for s in mine)
        pre_tps = statistics.median(s["prompt_tokens"] / s["prefill_ms"] * 1e3 for s in mine)
        nbytes = step_bytes(arts[dtype])
        floor = nbytes / (bw["read_gbps"] * 1e9) * 1e3
        hf = samples[("transformers", dtype)]
        hf_ms = statistics.median(s["ms_per_token"] for s in hf)
        hf_tps = statistics.median(s["prompt_tokens"] / s["prefill_ms"] * 1e3 for s in hf)
        result["decode"][f"{path} {dtype}"] = {
            "ms_per_token": ms, "floor_ms": floor, "step_bytes": nbytes, "prefill_ms": pre,
            "prompt_tokens": prompt, "prefill_tokens_per_s": pre_tps, "x_floor": ms / floor,
            "tokens_per_s_x_transformers": hf_ms / ms, "prefill_x_transformers": pre_tps / hf_tps}
        print(f"{path:<14}{dtype:<9}{ms:>10.2f}{floor:>10.2f}{ms / floor:>9.2f}"
              f"{hf_ms / ms:>13.2f}{prompt:>8.0f}{pre:>12.1f}{pre_tps:>15.0f}"
              f"{pre_tps / hf_tps:>8.2f}")
    print(f"\ncompile cache ({cache['entries']} entries): first load {cache['first_load_s']:.2f} s "
          f"(compile {cache['first_compile_s']:.2f} s), second load {cache['second_load_s']:.2f} s "
          f"(cache {cache['second_compile_s']:.2f} s): {cache['first_load_s'] / cache['second_load_s']:.1f}x "
          f"faster")
    for dtype, r in rows.items():
        print(f"decode executable, {dtype}: 1 row {r['one_row_ms']:.1f} ms, 4 rows "
              f"{r['4_rows_ms']:.1f} ms: {r['ratio']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime_bench.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

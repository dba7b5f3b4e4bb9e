#!/usr/bin/env python3
"""The context benchmark, against a running server (tlaloc serve).

Per context bucket: the prompt's prefill time and tokens/s; decode ms a step with 1, 2 and 4
sequences stepping together, their tokens/s, and the executions the backend ran per 64 steps
(from the metrics port). Then a concurrency sweep at 1, 2, 4 and 8 sequences on the smallest
bucket: aggregate tokens/s, each stream's wall time, the slowest stream named.

Method: one warm-up pass first; every figure is the median of --runs runs; prompts are seeded
random ids, unique per run; nothing else should run on the machine. Writes JSON and, when
matplotlib is installed (pip install 'triton-tlaloc[bench]'), a PNG.

    .venv/bin/python scripts/context_bench.py --url 127.0.0.1:8001 --metrics
        http://127.0.0.1:8002/metrics --model smollm2 --contexts 128,512 --out artifacts/ctx
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, TlalocClient, metric,  # noqa: E402
                                  new_sequence_id, scrape_metrics)

STEPS = 16


class Bench:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)

    def client(self) -> TlalocClient:
        return TlalocClient(self.args.url, self.args.model, self.args.protocol)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.args.vocab_hi) for _ in range(n)]

    def executions(self) -> float:
        return metric(scrape_metrics(self.args.metrics, settle_s=METRICS_SETTLE_S),
                      "tlaloc_executions_total",
                      model=self.args.model, kind="decode")

    def prefill(self, n: int) -> float:
        """Seconds for one n-token prompt (START) through the server."""
        with self.client() as c:
            sid = new_sequence_id()
            t0 = time.perf_counter()
            c.infer(sid, self.prompt(n), start=True)
            dt = time.perf_counter() - t0
            c.infer(sid, [], end=True)
        return dt

    def decode(self, seqs: int, prompt_len: int, steps: int = STEPS) -> dict:
        """`seqs` sequences started together, then `steps` greedy steps each with no pause."""
        prompts = [self.prompt(prompt_len) for _ in range(seqs)]
        barrier = threading.Barrier(seqs)
        step_ms: list[list[float]] = [[] for _ in range(seqs)]
        walls = [0.0] * seqs

        def worker(i):
            with self.client() as c:
                sid = new_sequence_id()
                barrier.wait()
                logits, _ = c.infer(sid, prompts[i], start=True)
                t_first = time.perf_counter()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    logits, _ = c.infer(sid, [int(np.argmax(logits))])
                    step_ms[i].append((time.perf_counter() - t0) * 1e3)
                walls[i] = time.perf_counter() - t_first
                c.infer(sid, [], end=True)

        before = self.executions() if self.args.metrics else 0.0
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(seqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        execs = (self.executions() - before) if self.args.metrics else float("nan")
        return {"ms_per_step": statistics.median(x for s in step_ms for x in s),
                "tokens_per_s": seqs * steps / max(walls),
                "executions_per_64_steps": execs / (seqs * steps) * 64,
                "stream_walls_s": walls}


def median_of(runs: int, fn):
    results = [fn() for _ in range(runs)]
    if isinstance(results[0], dict):
        return {k: statistics.median(r[k] for r in results) for k in results[0]
                if isinstance(results[0][k], float)}
    return statistics.median(results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    ap.add_argument("--metrics", default="http://127.0.0.1:8002/metrics",
                    help="the metrics URL ('' to skip the execution counts)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", required=True, help="context buckets, e.g. 128,512")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-hi", type=int, default=1000, help="prompt ids are drawn below this")
    ap.add_argument("--out", type=Path, default=Path("artifacts/context_bench"))
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    bench = Bench(args)

    print("warm-up ...", file=sys.stderr, flush=True)
    bench.prefill(8)
    bench.decode(1, 8, steps=4)

    result = {"model": args.model, "protocol": args.protocol, "runs": args.runs,
              "contexts": {}, "concurrency": {}}
    print("| context | prompt | prefill | tokens/s | 1 seq ms/step | 2 seqs | 4 seqs | "
          "4 seqs tokens/s | executions per 64 steps (1/2/4) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for ctx in contexts:
        n = max(1, ctx - STEPS - 8)  # the prompt and the steps fit the bucket
        pre = median_of(args.runs, lambda: bench.prefill(n))
        dec = {k: median_of(args.runs, lambda k=k: bench.decode(k, n)) for k in (1, 2, 4)}
        result["contexts"][ctx] = {"prompt": n, "prefill_s": pre, "prefill_tokens_per_s": n / pre,
                                   "decode": dec}
        print(f"| {ctx} | {n} | {pre * 1e3:.0f} ms | {n / pre:.0f} | "
              f"{dec[1]['ms_per_step']:.1f} | {dec[2]['ms_per_step']:.1f} | "
              f"{dec[4]['ms_per_step']:.1f} | {dec[4]['tokens_per_s']:.1f} | "
              f"{dec[1]['executions_per_64_steps']:.0f} / {dec[2]['executions_per_64_steps']:.0f}"
              f" / {dec[4]['executions_per_64_steps']:.0f} |", flush=True)

    print("\n| concurrent sequences | aggregate tokens/s | slowest stream | its wall |")
    print("|---:|---:|---:|---:|")
    for k in (1, 2, 4, 8):
        runs = [bench.decode(k, 16, steps=32) for _ in range(args.runs)]
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        walls = runs[-1]["stream_walls_s"]
        slowest = int(np.argmax(walls))
        result["concurrency"][k] = {"tokens_per_s": tps, "stream_walls_s": walls,
                                    "slowest_stream": slowest}
        print(f"| {k} | {tps:.1f} | stream {slowest} | {walls[slowest]:.2f} s |", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_bench.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        ks = sorted(result["concurrency"])
        a.plot(ks, [result["concurrency"][k]["tokens_per_s"] for k in ks], marker="o")
        a.set_xlabel("concurrent sequences")
        a.set_ylabel("aggregate tokens/s")
        b.plot(contexts, [result["contexts"][c]["prefill_s"] for c in contexts], marker="o")
        b.set_xlabel("context bucket")
        b.set_ylabel("prefill s")
        fig.suptitle(f"{args.model} over {args.protocol}")
        fig.tight_layout()
        fig.savefig(args.out / "context_bench.png")
        print(f"wrote {args.out}/context_bench.json and .png", file=sys.stderr)
    except ImportError:
        print(f"wrote {args.out}/context_bench.json (no plot: matplotlib is not installed)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

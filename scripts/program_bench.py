#!/usr/bin/env python3
"""What grouping by row shape buys a generic program under Triton's dynamic batcher: the rows
program of checks/programs.py (y = x * w + the row's sum, rows of width 3 or 5) served three
ways by one tritonserver, each sent the same burst of concurrent requests in turn, round after
round (fresh values every round; the first round of each is a warm-up, not counted):

- rows:          max batch 16, group_by_shape true (the default)
- rows_nogroup:  max batch 16, group_by_shape false (only consecutive requests of one width)
- rows_single:   max_batch_size 0 (no dynamic batcher: one execution per request)

Prints per model the median executions, Triton batches, the backend's busy time for a burst
(time in execute(): the server's work) against rows_single's, and the client's wall time.

    .venv/bin/python scripts/program_bench.py [--requests 216] [--rounds 5] [--width-b 64]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks import programs  # noqa: E402

from triton_tlaloc.frontends.client import METRICS_SETTLE_S, metric, scrape_metrics  # noqa: E402
from triton_tlaloc.repository import ProgramOptions, write_program_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402

MODELS = ("rows", "rows_nogroup", "rows_single")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "program-bench")
    ap.add_argument("--requests", type=int, default=programs.RAGGED_REQUESTS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width-a", type=int, default=3)
    ap.add_argument("--width-b", type=int, default=5)
    args = ap.parse_args()
    if args.work.exists():
        shutil.rmtree(args.work)
    built = programs.build_programs(args.work / "programs")
    repo = args.work / "repo"
    rows = dict(arguments="input:X,weight:scale.bin", results="output:Y")
    batched = dict(rows, max_batch_size=programs.RAGGED_MAX_BATCH)
    for name, opts in (("rows", ProgramOptions(**batched)),
                       ("rows_nogroup", ProgramOptions(**batched, group_by_shape=False)),
                       ("rows_single", ProgramOptions(**rows))):
        write_program_repository(built["rows"], repo, name, opts)
    server = TritonServer(repo, log_path=args.work / "tritonserver.log", exit_timeout_s=3)
    server.start()
    results = {m: [] for m in MODELS}
    try:
        for rnd in range(args.rounds + 1):
            rng = np.random.default_rng(rnd)
            widths = rng.choice((args.width_a, args.width_b), args.requests)
            xs = [rng.integers(-50, 50, (1, int(w))).astype(np.float32) for w in widths]
            want = [x * programs.ROW_SCALE + x.sum(-1, keepdims=True) for x in xs]
            for model in MODELS:
                before = scrape_metrics(server.metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
                t0 = time.perf_counter()
                got = programs.send_concurrently(server.grpc_url, model, xs)
                wall = time.perf_counter() - t0
                after = scrape_metrics(server.metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
                if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                    raise SystemExit(f"{model}: rows differ from numpy in round {rnd}")
                if rnd:  # round 0 warms up (compiles every batch shape)
                    results[model].append(tuple(
                        metric(after, name, model=model) - metric(before, name, model=model)
                        for name in ("tlaloc_program_executions_total", "nv_inference_exec_count",
                                     "tlaloc_program_busy_seconds_total")) + (wall,))
    finally:
        server.stop()
    single = statistics.median(r[2] for r in results["rows_single"])  # busy seconds
    print(f"\n{args.requests} concurrent requests of widths {args.width_a} and {args.width_b}, "
          f"gRPC, medians of {args.rounds} rounds (after a warm-up round), one tritonserver, "
          f"models in turn; every answer equal to numpy\n")
    print(f"{'model':<14} {'executions':>10} {'batches':>8} {'busy ms':>8} {'busy vs single':>14} "
          f"{'burst ms':>9} {'requests/s':>11}")
    for model in MODELS:
        ex, batches, busy, wall = (statistics.median(r[i] for r in results[model])
                                   for i in range(4))
        print(f"{model:<14} {ex:>10.0f} {batches:>8.0f} {busy * 1e3:>8.1f} "
              f"{busy / single:>13.2f}x {wall * 1e3:>9.1f} {args.requests / wall:>11.0f}")
    print("\nbusy: time the backend spent in execute() for the burst (the server's work); "
          "burst: the client's wall time, sending included")
    return 0


if __name__ == "__main__":
    sys.exit(main())

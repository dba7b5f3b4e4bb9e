"""What choosing a token costs a row, the sampler against sampling by the book, in one run.

Generations of the generate model sample on the sequence model's batching thread (their next
step is queued by their reply), so a row's sampling time is paid by every sequence of the call.
This times `Sampler.choose` and the by-the-book reference (checks/sampling_reference.py:
temperature, top-k, a stable sort of the whole vocabulary for top-p, Generator.choice) over the
same rows of a 49k vocabulary, peaked and flat ones in turn, after a warm-up; medians of
`--runs` runs; microseconds a row and the ratio.

    .venv/bin/python scripts/sampling_bench.py [--rows 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.sampling_reference import logit_rows, reference_choice, reference_probs  # noqa: E402

from triton_tlaloc.generation.sampling import Sampler, SamplingParams  # noqa: E402

SETTINGS = ({"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "top_k": 50},
            {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_k": 50, "top_p": 0.95})


def per_row_us(choose, rows) -> float:
    t0 = time.perf_counter()
    for row in rows:
        choose(row)
    return (time.perf_counter() - t0) / len(rows) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = logit_rows(args.rows)
    print(f"{args.rows} rows of {rows[0].size} logits (peaked and flat in turn), medians of "
          f"{args.runs} runs after a warm-up; {os.cpu_count()} cores\n")
    print("| settings | sampler us a row | by the book us a row | book / sampler |")
    print("|---|---:|---:|---:|")
    for settings in SETTINGS:
        params = SamplingParams(seed=0, **settings)
        sampler = Sampler(params)
        rng = np.random.default_rng(0)
        book = (lambda row: int(np.argmax(row))) if params.greedy else (
            lambda row: reference_choice(reference_probs(row, params), rng))
        timings = {"sampler": [], "book": []}
        for run in range(args.runs + 1):  # run 0 warms up
            for name, choose in (("sampler", sampler.choose), ("book", book)):
                us = per_row_us(choose, rows)
                if run:
                    timings[name].append(us)
        s, b = (statistics.median(timings[k]) for k in ("sampler", "book"))
        shown = ", ".join(f"{k} {v}" for k, v in settings.items())
        print(f"| {shown} | {s:,.0f} | {b:,.0f} | {b / s:.1f} |")


if __name__ == "__main__":
    main()

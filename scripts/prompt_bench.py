#!/usr/bin/env python3
"""Time to first token through the engine, by prompt length, for several artifacts side by
side in one run: what a prompt's calls cost (the entry chosen, its padding, the weights'
layout), with no server, transport or batching around them.

Each artifact is loaded in this process by a runtime that compiles an entry on first use (so
only the entries the prompts run are compiled); every prompt length runs once untimed on each
artifact first. Then --rounds rounds: in each, every prompt length on every artifact in turn,
each prompt new seeded random ids (no KV reused: the engine's prefix reuse is not used; the
sequence is freed after its call). The figure is the median over the rounds of the time from
admitting the prompt to its logits (`Engine.prefill_chunked`), and the entries that ran.
Nothing else should run on the machine.

    .venv/bin/python scripts/prompt_bench.py NAME=ARTIFACT [NAME=ARTIFACT ...]
        [--prompt-tokens 40,100,158,300,480] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+", help="NAME=ARTIFACT_DIR, the first the reference")
    ap.add_argument("--prompt-tokens", type=int_list, default=[40, 100, 158, 300, 480])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.kv.sequence import Sequence
    from triton_tlaloc.runtime.core import Runtime

    engines, ran = {}, {}
    for spec in args.artifacts:
        name, _, path = spec.partition("=")
        runtime = Runtime(Path(path), first_use=True)
        ran[name] = []

        def recording(entry, step, run=runtime.run, log=ran[name]):
            log.append(entry)
            return run(entry, step)
        runtime.run = recording  # the entries each prompt runs
        engines[name] = Engine(runtime)
    rng = np.random.default_rng(args.seed)

    def prompt_ms(name: str, n: int) -> tuple[float, str]:
        engine = engines[name]
        seq = Sequence([])
        engine.admit(seq, [int(t) for t in rng.integers(100, 40000, n)])
        ran[name].clear()
        t0 = time.perf_counter()
        engine.prefill_chunked(seq)
        took = (time.perf_counter() - t0) * 1e3
        engine.free(seq)
        return took, " + ".join(ran[name])

    entries: dict[tuple[str, int], str] = {}
    for name in engines:
        for n in args.prompt_tokens:
            _, entries[name, n] = prompt_ms(name, n)  # compiles what this length runs
    times: dict[tuple[str, int], list[float]] = {k: [] for k in entries}
    for r in range(args.rounds):
        for n in args.prompt_tokens:
            for name in engines:
                times[name, n].append(prompt_ms(name, n)[0])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    names = list(engines)
    ref = names[0]
    head = f"{'prompt tokens':>13}" + "".join(f"{n:>22}" for n in names)
    print(head)
    for n in args.prompt_tokens:
        row = f"{n:>13}"
        for name in names:
            ms = statistics.median(times[name, n])
            ratio = ms / statistics.median(times[ref, n])
            row += f"{ms:>12.1f} ms" + (f" {ratio:5.2f}x" if name != ref else " " * 6)
        print(row)
    for (name, n), calls in entries.items():
        print(f"  {name}, {n} tokens: {calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

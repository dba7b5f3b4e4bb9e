#!/usr/bin/env python3
"""A prompt beside decoding streams: separate calls against one mixed call, side by side in one
run, through the engine (no server).

For R streams (each a unique prompt of --history tokens, decoding) and a new prompt of
--prompt tokens, one "round" computes every stream's next token and the whole new prompt:

- apart: the decode call of the R rows, then the prompt's prefill call(s) (what a round costs
  the streams without mixed entries: their next token waits for both);
- mixed: the prompt in chunks of T tokens, each chunk in one mixed call with the R rows (the
  streams get a token per chunk, so their step is one mixed call).

Printed per R and T: the round's time both ways, the streams' longest wait between tokens
(apart: the round; mixed: the slowest mixed call) and the ratios, with the decode step alone
and the prefill alone for reference; and per R over 4, the streams' step in one call against
calls of 4 rows (an export whose batches stop at 4). Medians over --rounds rounds after one untimed round;
every prompt unique. Run it on an otherwise idle machine:

    .venv/bin/python scripts/mixed_step_bench.py ARTIFACT [--rows 1,4,16] [--prompt 158]

The artifact needs mixed entries (`tlaloc export ... --mixed-tokens 64,128,192`) and decode
entries of each R.
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

from triton_tlaloc.engine.core import Engine  # noqa: E402
from triton_tlaloc.kv.sequence import Sequence  # noqa: E402
from triton_tlaloc.runtime.core import Runtime  # noqa: E402


def streams(engine: Engine, rng, rows: int, history: int) -> list[Sequence]:
    seqs = []
    for _ in range(rows):
        seq = Sequence([])
        engine.admit(seq, [int(t) for t in rng.integers(100, 40000, history)])
        logits = engine.prefill_chunked(seq)
        engine.admit(seq, [int(np.argmax(logits[0]))])
        seqs.append(seq)
    return seqs


def next_tokens(engine: Engine, seqs: list[Sequence], logits) -> None:
    for seq, row in zip(seqs, logits):
        engine.admit(seq, [int(np.argmax(row))])


def new_prompt(engine: Engine, rng, n: int) -> Sequence:
    seq = Sequence([])
    engine.admit(seq, [int(t) for t in rng.integers(100, 40000, n)])
    return seq


def round_apart(engine, seqs, rng, n) -> dict:
    prompt = new_prompt(engine, rng, n)
    t0 = time.perf_counter()
    logits = engine.decode(seqs)
    t1 = time.perf_counter()
    engine.prefill_chunked(prompt)
    t2 = time.perf_counter()
    next_tokens(engine, seqs, logits)
    engine.free(prompt)
    return {"round": t2 - t0, "wait": t2 - t0, "decode": t1 - t0, "prefill": t2 - t1}


def decode_in_calls(engine, seqs, rows) -> float:
    """One step of every stream in calls of `rows` rows (a ladder that stops at `rows`)."""
    t0 = time.perf_counter()
    for i in range(0, len(seqs), rows):
        part = seqs[i:i + rows]
        next_tokens(engine, part, engine.decode(part))
    return time.perf_counter() - t0


def round_mixed(engine, seqs, rng, n, chunk) -> dict:
    prompt = new_prompt(engine, rng, n)
    calls = []
    t0 = time.perf_counter()
    while prompt.uncached:
        t = time.perf_counter()
        logits = engine.mixed(seqs, prompt, chunk)
        assert logits is not None, f"no mixed entry holds {len(seqs)} rows and {chunk} tokens"
        calls.append(time.perf_counter() - t)
        next_tokens(engine, seqs, logits[:-1])
    engine.free(prompt)
    return {"round": time.perf_counter() - t0, "wait": max(calls), "calls": len(calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=158)
    ap.add_argument("--history", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rt = Runtime(args.artifact)
    engine = Engine(rt)
    rng = np.random.default_rng(0)
    chunks = sorted({e.tokens_per_seq for e in rt.artifact.entries.values()
                     if e.kind == "mixed"})
    print(f"{args.artifact}: a prompt of {args.prompt} tokens beside R streams "
          f"({args.history}-token histories); ms, medians of {args.rounds} rounds")
    print("| R | T | apart: decode + prefill | mixed: round (calls) | round mixed / apart "
          "| streams' longest wait, mixed / apart |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        seqs = streams(engine, rng, rows, args.history)
        apart = [round_apart(engine, seqs, rng, args.prompt) for _ in range(args.rounds + 1)][1:]
        a = {k: statistics.median(r[k] for r in apart) for k in apart[0]}
        if rows > 4:
            fours = statistics.median(decode_in_calls(engine, seqs, 4)
                                      for _ in range(args.rounds + 1))
            whole = statistics.median(decode_in_calls(engine, seqs, rows)
                                      for _ in range(args.rounds + 1))
            print(f"| {rows} | step | one call of {rows}: {whole * 1e3:.1f} | calls of 4: "
                  f"{fours * 1e3:.1f} | {whole / fours:.2f}x | |", flush=True)
        for chunk in chunks:
            mixed = [round_mixed(engine, seqs, rng, args.prompt, chunk)
                     for _ in range(args.rounds + 1)][1:]
            m = {k: statistics.median(r[k] for r in mixed) for k in mixed[0]}
            print(f"| {rows} | {chunk} | {a['decode'] * 1e3:.1f} + {a['prefill'] * 1e3:.1f} "
                  f"= {a['round'] * 1e3:.1f} | {m['round'] * 1e3:.1f} ({m['calls']:.0f}) "
                  f"| {m['round'] / a['round']:.2f}x | {m['wait'] * 1e3:.1f} / "
                  f"{a['wait'] * 1e3:.1f} = {m['wait'] / a['wait']:.2f}x |", flush=True)
        for seq in seqs:
            engine.free(seq)


if __name__ == "__main__":
    main()

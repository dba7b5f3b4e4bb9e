"""The batcher's own Python a round, in this process: no Triton, no client, no model.

64 generations of the generate model's local loop (local_generation.Generation: greedy, a
reply chooses the token and queues the next step) run through a real `Batcher` over the
simulated runtime with a step of 0 ms, on a fake artifact of SmolLM2's vocabulary (49,152)
with batches 1, 8 and 64. What a round costs is then what the batcher adds to a device's step
at 64 rows: admission, the step inputs, the replies, choosing each row's token, and the
simulated runtime's logits (an array of 64 x 49,152 zeros, as a real copy of the logits
allocates). Medians of `--runs` runs of 64 tokens a sequence after a warm-up.

    .venv/bin/python scripts/round_bench.py [--sequences 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.fakes import fake_artifact  # noqa: E402

from triton_tlaloc.batcher import Batcher  # noqa: E402
from triton_tlaloc.engine.core import Engine  # noqa: E402
from triton_tlaloc.generation.sampling import SamplingParams  # noqa: E402
from triton_tlaloc.generation.local_generation import Generation  # noqa: E402
from triton_tlaloc.scheduling.policy import BatchPolicy  # noqa: E402
from triton_tlaloc.runtime.simulated import SimulatedRuntime  # noqa: E402

TOKENS = 64


def one_run(batcher: Batcher, sequences: int) -> tuple[int, float]:
    """(rounds, seconds) for `sequences` generations of TOKENS tokens, rounds driven here."""
    queued: list = []
    gens = [Generation(i, [3 + i, 5, 7], SamplingParams(max_tokens=TOKENS), set(), 256,
                       lambda event: None, queued.extend) for i in range(sequences)]
    batcher.submit_group([g.start_request() for g in gens])
    rounds = 0
    t0 = time.perf_counter()
    while not all(g.finished for g in gens) or queued:
        ran = batcher.run_pending()
        rounds += ran
        if queued:
            batcher.submit_group(queued[:])
            queued.clear()
        elif not ran:
            time.sleep(0.0002)  # a prompt waits for the others sent with it (prefill wait)
    batcher.run_pending()  # the ENDs
    return rounds, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    art = fake_artifact(batch_ladder=(1, 8, 64), context_ladder=(256,), block_size=16,
                        num_blocks=args.sequences * 16 + 1, vocab=49_152, prefill_tokens=())
    batcher = Batcher(Engine(SimulatedRuntime(art, 0.0)), BatchPolicy())
    per_round = []
    for run in range(args.runs + 1):  # run 0 warms up
        rounds, seconds = one_run(batcher, args.sequences)
        if run:
            per_round.append(seconds / rounds)
    ms = statistics.median(per_round) * 1e3
    print(f"{args.sequences} sequences, {TOKENS} tokens each, step 0 ms, {os.cpu_count()} cores: "
          f"{ms:.2f} ms a round, {ms * 1e3 / args.sequences:.1f} us a row (median of "
          f"{args.runs} runs; runs {', '.join(f'{s * 1e3:.2f}' for s in per_round)} ms)")


if __name__ == "__main__":
    main()

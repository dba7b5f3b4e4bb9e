#!/usr/bin/env python3
"""What structured output costs a step, on an artifact's tokenizer: the mask's computing (on the
worker thread, hidden behind the step's call) and its application to a row of logits (on the
thread that chooses the token, paid by the step), per step of answers written under a JSON
schema, a regex and a choice. The answers are chosen greedily from seeded random logits (no
model: the grammar's cost alone), so every step is one a model could take.

    .venv/bin/python scripts/structured_bench.py ARTIFACT_DIR [--answers 20]

Prints the median, p99 and largest time per step for each constraint, and the step count.
Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string",
                                                              "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2} [a-z]{3,8}"},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed feelings"]},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--answers", type=int, default=20, help="answers per constraint")
    args = ap.parse_args()

    from triton_tlaloc.artifact.loading import load_artifact
    from triton_tlaloc.generation.structured import (GrammarObserver, Grammars,
                                                     StructuredOutput)

    class MaskTimes(GrammarObserver):
        def __init__(self):
            self.seconds = []

        def masked(self, seconds):
            self.seconds.append(seconds)

    art = load_artifact(args.artifact)
    vocab, eos = art.model.vocab, list(art.model.eos_token_ids)
    times = MaskTimes()
    grammars = Grammars(art.tokenizer_dir, vocab, eos, observer=times)
    t0 = time.perf_counter()
    grammars.tokenizer()
    print(f"llguidance's tokenizer: {time.perf_counter() - t0:.2f} s, {vocab} tokens")
    rng = np.random.default_rng(0)
    print(f"{'constraint':<12} {'steps':>6} {'compile ms':>11} {'mask median us':>15} "
          f"{'p99 us':>8} {'max us':>8} {'apply median us':>16}")
    for name, d in CONSTRAINTS.items():
        spec = StructuredOutput.from_dict(d)
        t0 = time.perf_counter()
        grammars.grammar(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        times.seconds, applies, steps = [], [], 0
        for _ in range(args.answers):
            c = grammars.constraint(spec, set(eos))
            for _ in range(500):
                logits = rng.standard_normal(vocab).astype(np.float32)
                c.allowed()  # the mask, once the worker has it
                t0 = time.perf_counter()
                masked = c.masked(logits)
                token = int(np.argmax(masked))
                applies.append(time.perf_counter() - t0)
                steps += 1
                if token in eos:
                    break
                c.took(token)
        c.allowed()  # the last mask computed
        m = np.array(times.seconds) * 1e6
        print(f"{name:<12} {steps:>6} {compile_ms:>11.1f} {np.median(m):>15.1f} "
              f"{np.percentile(m, 99):>8.1f} {m.max():>8.1f} "
              f"{np.median(applies) * 1e6:>16.1f}")
    grammars.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Decode speed by stored type, side by side in one run: SmolLM2-135M-Instruct (the offline
GGUF) exported with f32, bf16, int8 and fp8 weights and with fp8 KV pools, each with the layer
loop and with its layers unrolled, run through the engine (no server): the decode ms per token
of one sequence after a 48-token prompt, and that against the same layout's f32 export.

What it shows: which stored types XLA's CPU backend reads in place in each layout. The loop
slices a layer's weights out of stacked ones on every step and an fp8 pool is gathered a page
at a time; given bf16 or f8 values there, XLA widens or copies the whole array on every call,
so the programs take those tensors as their bits (docs/artifact-format.md#tensors-taken-as-their-bits).

Method: every export is loaded in this process (its entries compiled on first use) and warmed
with 4 tokens; then --rounds rounds, each running every export in turn, a round's figure the
median ms per token over 32 greedy tokens after a new seeded prompt; the table gives the
median over the rounds. Context 2,048 with 300 pages, so the pools are a realistic size.
Nothing else should run on the machine.

    .venv/bin/python scripts/stored_types_bench.py [--rounds 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name: ExportOptions fields
    "f32": {},
    "bf16 weights": {"weight_dtype": "bf16"},
    "int8 weights": {"weight_quant": "int8"},
    "fp8 weights": {"weight_quant": "fp8"},
    "fp8 KV": {"kv_dtype": "fp8"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where the exports go (a temporary "
                    "directory by default)")
    args = ap.parse_args()

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path
    from triton_tlaloc.runtime.core import Runtime

    work = args.work or Path(tempfile.mkdtemp(prefix="tlaloc-stored-types-"))
    gguf = smollm2_gguf_path()
    engines = {}
    for name, fields in VARIANTS.items():
        for loop in (True, False):
            out = work / f"{name.replace(' ', '-')}-{'loop' if loop else 'unrolled'}"
            if not out.exists():
                export_artifact(gguf, out, ExportOptions(
                    batch_ladder=(1,), context_ladder=(2048,), prefill_tokens=(64,),
                    num_blocks=300, layer_loop=loop, **fields))
            engine = Engine(Runtime(out, platform="cpu"))
            engine.generate_greedy([1, 2, 3, 4], 4)
            engines[(name, loop)] = engine
    rng = np.random.default_rng(0)
    ms = {key: [] for key in engines}
    for r in range(args.rounds):
        for key, engine in engines.items():
            prompt = [int(t) for t in rng.integers(100, 49000, 48)]
            ms[key].append(engine.generate_greedy(prompt, 33).median_ms_per_token)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    med = {key: statistics.median(v) for key, v in ms.items()}
    print("| stored | loop, ms/token | vs f32 | unrolled, ms/token | vs f32 |")
    print("|---|---:|---:|---:|---:|")
    for name in VARIANTS:
        cells = []
        for loop in (True, False):
            m = med[(name, loop)]
            cells += [f"{m:.1f}", f"{m / med[('f32', loop)]:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Which key blocks a decode call's attention should loop in, by rows and by what the rows hold:
SmolLM2-135M's attention (9 heads, 3 KV heads of 64, 30 layers of one stacked f32 pool of 1,025
pages of 16) through export/attention.py `by_length`, as a layer loop runs it, for each set of
key blocks, in a 4,096-position bucket; every row holds the same number of positions on pages
of its own. Only attention: no linears, no KV write.

A figure is the median of 6 calls after one untimed, ms; everything in this process, one set
after another (docs/performance.md#a-buffer-per-layer-and-a-smaller-key-block-for-many-rows).

    .venv/bin/python scripts/key_block_bench.py [--rows 1,4,16] [--held 40,150,300,600,1000]
        [--blocks "256,1024;64,256,1024"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from triton_tlaloc.export.attention import LayerPool, by_length

LAYERS, PAGES, PAGE, KV_HEADS, GROUP, HEAD = 30, 1025, 16, 3, 3, 64
BUCKET_PAGES = 256  # 4,096 positions


def attention_of_every_layer(tables, positions, seq_lens, blocks):
    def run(q, k_pool, v_pool):
        def layer(i, acc):
            # acc * 0 keeps each layer's attention inside the loop (it depends on the carry)
            return acc + by_length(q + acc * 0, LayerPool(k_pool, i), LayerPool(v_pool, i),
                                   tables, positions, seq_lens, blocks)
        return lax.fori_loop(0, LAYERS, layer, jnp.zeros_like(q))
    return jax.jit(run)


def median_ms(fn, *args) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--held", default="40,150,300,600,1000")
    ap.add_argument("--blocks", default="256,1024;64,256,1024", help="';'-separated sets")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pools = [jnp.asarray(rng.standard_normal((PAGES, LAYERS, PAGE, KV_HEADS, HEAD),
                                             dtype=np.float32)) for _ in range(2)]
    sets = [tuple(int(b) for b in s.split(",")) for s in args.blocks.split(";") if s]
    print("| rows | held | " + " | ".join("/".join(map(str, s)) for s in sets) + " |")
    print("|---:|---:|" + "---:|" * len(sets))
    for rows in (int(r) for r in args.rows.split(",")):
        q = jnp.asarray(rng.standard_normal((rows, 1, KV_HEADS, GROUP, HEAD), dtype=np.float32))
        for held in (int(h) for h in args.held.split(",")):
            per = -(-held // PAGE)
            tables = np.zeros((rows, BUCKET_PAGES), np.int32)
            for r in range(rows):
                tables[r, :per] = 1 + (r * per + np.arange(per)) % (PAGES - 1)
            step = (jnp.asarray(tables), jnp.full((rows, 1), held - 1, jnp.int32),
                    jnp.full((rows,), held, jnp.int32))
            cells = [f"{median_ms(attention_of_every_layer(*step, s), q, *pools):.1f}"
                     for s in sets]
            print(f"| {rows} | {held} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

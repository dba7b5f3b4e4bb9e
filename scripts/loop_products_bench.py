#!/usr/bin/env python3
"""How the layer loop's linears cost by rows: SmolLM2-135M's 30 layers of linears (q|k|v, o,
gate|up, down; random f32 weights of the real shapes) stacked over the layers and run in one
`lax.scan`, as an entry's loop runs them, in each way of writing a product:

    [out,in] rows     a matrix-vector product per row (what the exporter writes up to
                      export/layers.py MATVEC_ROWS rows)
    [out,in] dot      one product of all the rows on the transposed operand (past that)
    [out,in] blocks   the weight in blocks of 32 outputs, one batched product
    [in,out] dot      the weight stored the other way, one product on each layer's slice
    [in,out] layer    a buffer of its own per layer, [in, out], picked by a switch on the
                      loop's layer (the exporter's copy, read past layers.IN_OUT_ROWS rows)

A figure is the median of 7 calls after one untimed, ms; everything in this process, one way
after another. It says which form a decode entry of R rows should use, and what a prompt's (or
a mixed call's) rows cost in each layout (docs/performance.md#many-users-mixed-steps-and-batches-of-16).

    .venv/bin/python scripts/loop_products_bench.py [--rows 1,4,8,16,32,144,208]
        [--forms "[out,in] rows;[out,in] dot"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LAYERS, HIDDEN, INTERMEDIATE = 30, 576, 1536
# (in, out) of q|k|v, o, gate|up and down
SHAPES = ((576, 960), (576, 576), (576, 2 * 1536), (1536, 576))
FORMS = ("[out,in] rows", "[out,in] dot", "[out,in] blocks", "[in,out] dot", "[in,out] layer")
HIGHEST = lax.Precision.HIGHEST


def stacked(rng, out_first: bool) -> list:
    ws = []
    for n_in, n_out in SHAPES:
        w = rng.standard_normal((LAYERS, n_in, n_out), dtype=np.float32) * 0.02
        ws.append(jnp.asarray(np.ascontiguousarray(w.transpose(0, 2, 1)) if out_first else w))
    return ws


def per_layer(ws: list) -> list:
    """Each stack as a tuple of buffers, one per layer."""
    return [tuple(jnp.asarray(np.asarray(w[i])) for i in range(LAYERS)) for w in ws]


def product(x, w, form: str):
    if form == "[in,out] dot":
        return jnp.matmul(x, w, precision=HIGHEST)
    if form == "[out,in] rows":
        return jnp.stack([jnp.dot(w, r, precision=HIGHEST) for r in x])
    if form == "[out,in] blocks":
        n_out = w.shape[0]
        y = jnp.einsum("bki,ri->brk", w.reshape(n_out // 32, 32, w.shape[1]), x,
                       precision=HIGHEST)
        return y.transpose(1, 0, 2).reshape(x.shape[0], n_out)
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=HIGHEST)


def layers_fn(form: str):
    if form == "[in,out] layer":
        def each(i, x, buffers):
            return lax.switch(i, [lambda x, w=w: product(x, w, "[in,out] dot")
                                  for w in buffers], x)

        def pick(x, ws):
            return lax.fori_loop(0, LAYERS, lambda i, x: layer(
                x, *(lambda x, b=b, i=i: each(i, x, b) for b in ws)), x)

        return jax.jit(pick)

    def body(x, w):
        return layer(x, *(lambda x, w=part: product(x, w, form) for part in w)), None

    return jax.jit(lambda x, ws: lax.scan(body, x, ws)[0])


def layer(x, qkv, o, gate_up, down):
    """One layer's linears, each a function of its input."""
    h = o(qkv(x)[:, :HIDDEN])
    g = gate_up(h)
    return x + down(jax.nn.silu(g[:, :INTERMEDIATE]) * g[:, INTERMEDIATE:]) * 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,144,208")
    ap.add_argument("--forms", default=";".join(FORMS), help="';'-separated")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    forms = [f for f in args.forms.split(";") if f]
    print("| form | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|" + "---:|" * len(rows_list))
    for form in forms:
        ws, fn, cells = stacked(rng, not form.startswith("[in,out]")), layers_fn(form), []
        if form == "[in,out] layer":
            ws = per_layer(ws)
        for rows in rows_list:
            if form == "[out,in] rows" and rows > 32:  # a product per row of a prompt: no
                cells.append("-")
                continue
            x = jnp.asarray(rng.standard_normal((rows, HIDDEN), dtype=np.float32))
            fn(x, ws).block_until_ready()
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                fn(x, ws).block_until_ready()
                times.append(time.perf_counter() - t0)
            cells.append(f"{statistics.median(times) * 1e3:.1f}")
        print(f"| {form} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Why the decoder writes its linears the way it does: SmolLM2-135M's 30 layers of linears and
its tied head (random weights, the real shapes), with an RMSNorm in front of each, as XLA's CPU
backend runs them at 1 and at 4 rows (or --rows), one way of writing them at a time
(docs/performance.md).

    f32 [in,out]            an unrolled f32 artifact: x @ W
    f32 [out,in]            the layer loop's f32 weights: a matrix-vector product per row up to
                            8 rows (export/layers.py MATVEC_ROWS), x @ W^T past that
    bf16 [in,out]           bf16 weights as an f32 artifact lays them out: dot(bf16(x), W) -> f32
    bf16 [out,in] trip      widened in the product, input rounded by a bf16 round trip
    bf16 [out,in] rp        the same, input rounded by reduce_precision
    bf16 [out,in] rp+mat    the same, input materialized first (a reduce: the bf16 artifact)
    f32 [out,in] reduce     f32 weights, each row's product written as a multiply and a sum
                            (a reduction XLA fuses) instead of a dot
    q4 [out,in] dot         4-bit codes packed two a byte with an f32 scale per 32 (GGUF Q4_0's
                            values, export/gguf_packed.py's layout) widened, then a dot per row
    q4 [out,in] reduce      the same codes widened inside a multiply-and-sum per row (the
                            widening can fuse into the reduction: no f32 copy of the weight)
    q4 [out,in] shift       the same codes widened by reading each byte twice (shifted by 0
                            and 4, no concatenate), then a dot per row: XLA fuses the whole
                            widening into the matrix-vector product
    int8 [out,in] channel   int8 codes widened inside a dot per row, times a scale per output
                            channel (the exporter's int8)
    q4 shift i32            the same, each byte widened to int32 before it is shifted (x86 has
                            no shift of bytes: XLA's CPU code shifts them one at a time)
    q4 halves               byte j of a row holds column j (low half) and column j + in / 2
                            (high half): two dots per row, one per half, each widening with
                            one mask or one shift
    q4 halves one dot       the same bytes widened as [out, 2, in / 2] (low halves, then high
                            halves), one dot per row over the whole row
    q4 bands                codes two a byte along the rows instead (export/gguf_packed.py's
                            row bands: byte [i, j] holds rows i and i + out / 2 of column j):
                            a dot per band and row, each band widened by one shift and mask
    q4 bands offset         the same with an offset per group added (Q4_1, Q4_K)
    q4 factored             the codes' products summed per group of 32 first (an einsum),
                            then times each group's scale and summed: no scale per element
    q4 via int8             the codes unpacked to int8 first (a separate fusion, its output kept
                            apart by an optimization barrier), then as int8 groups
    int8 groups             int8 codes [out, in] with a scale per 32 (GGUF's per-group values
                            at a byte an element), widened inside a dot per row

Each variant and row count runs in its own process, in turn, for --rounds rounds; a figure is the
median over rounds of the median of 11 timed calls (after 3 untimed). GB/s is weight bytes over
time; GFLOP/s is 2 x weights x rows over time. --xla-flags runs every variant again under each
set of XLA_FLAGS given (sets separated by ';'), to try XLA's CPU options on the same products.

    .venv/bin/python scripts/xla_cpu_linears.py [--rounds 3] [--rows 1,4,32,256]
        [--variants "f32 [in,out];f32 [out,in]"] [--xla-flags "--xla_cpu_use_onednn=true"]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ["f32 [in,out]", "f32 [out,in]", "bf16 [in,out]", "bf16 [out,in] trip",
            "bf16 [out,in] rp", "bf16 [out,in] rp+mat", "f32 [out,in] reduce",
            "q4 [out,in] dot", "q4 [out,in] reduce", "q4 [out,in] shift", "q4 shift i32", "q4 halves",
            "q4 halves one dot", "q4 factored", "q4 via int8", "q4 bands", "q4 bands offset",
            "int8 [out,in] channel", "int8 groups",
            "uint8 masked groups"]
MATVEC_ROWS = 8  # export/layers.py (not imported: the figures are of XLA, not of the package)
LAYERS, HIDDEN, INTER, VOCAB, QKV = 30, 576, 1536, 49152, 576 + 2 * 192


def worker(variant: str, rows: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    f32 = variant.startswith("f32")
    q4 = variant.startswith("q4")
    int8 = variant.startswith("int8")
    out_first = "[out,in]" in variant
    dtype = jnp.float32 if f32 else jnp.bfloat16
    rng = np.random.default_rng(0)

    def weight(n_in, n_out):
        shape = (n_out, n_in) if out_first else (n_in, n_out)
        if variant == "uint8 masked groups":
            return (jnp.asarray(rng.integers(0, 256, (n_out, n_in), dtype=np.uint8)),
                    jnp.asarray(rng.random((n_out, n_in // 32), dtype=np.float32) * 0.01))
        if variant == "int8 groups":
            return (jnp.asarray(rng.integers(-8, 8, (n_out, n_in), dtype=np.int8)),
                    jnp.asarray(rng.random((n_out, n_in // 32), dtype=np.float32) * 0.01))
        if int8:
            return (jnp.asarray(rng.integers(-127, 128, (n_out, n_in), dtype=np.int8)),
                    jnp.asarray(rng.random((n_out,), dtype=np.float32) * 0.01))
        if variant.startswith("q4 bands"):  # (bytes [out / 2, in], scales, offsets)
            return (jnp.asarray(rng.integers(0, 256, (n_out // 2, n_in), dtype=np.uint8)),
                    jnp.asarray(rng.random((n_out, n_in // 32), dtype=np.float32) * 0.01),
                    jnp.asarray(rng.random((n_out, n_in // 32), dtype=np.float32) * 0.01))
        if q4:  # (nibbles [out, in / 2]: element i low, i + 16 high in each 32; scales)
            return (jnp.asarray(rng.integers(0, 256, (n_out, n_in // 2), dtype=np.uint8)),
                    jnp.asarray(rng.random((n_out, n_in // 32), dtype=np.float32) * 0.01))
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02, dtype=dtype)

    def widened(w):
        nibbles, scale = w
        n_out = nibbles.shape[0]
        if "shift" in variant:  # each byte read twice, shifted by 0 and 4: no concatenate
            g = nibbles.reshape(n_out, -1, 1, 16)
            if variant.endswith("i32"):
                shift = lax.broadcasted_iota(jnp.int32, (1, 1, 2, 1), 2) * 4
                q = ((g.astype(jnp.int32) >> shift) & 0x0F) - 8
            else:
                shift = lax.broadcasted_iota(jnp.uint8, (1, 1, 2, 1), 2) * 4
                q = ((g >> shift) & 0x0F).astype(jnp.int32) - 8
            return (q.astype(jnp.float32) * scale[:, :, None, None]).reshape(n_out, -1)
        g = nibbles.reshape(n_out, -1, 1, 16)
        q = jnp.concatenate([g & 0x0F, g >> 4], axis=2).reshape(n_out, -1, 32)
        return ((q.astype(jnp.int32) - 8).astype(jnp.float32) * scale[..., None]).reshape(
            n_out, -1)

    layers = [(weight(HIDDEN, QKV), weight(HIDDEN, HIDDEN), weight(HIDDEN, 2 * INTER),
               weight(INTER, HIDDEN)) for _ in range(LAYERS)]
    head = weight(HIDDEN, VOCAB)
    norm_w = jnp.full((HIDDEN,), 1.1, jnp.float32)

    def linear(x, w):
        if variant in ("int8 groups", "uint8 masked groups"):
            codes, scale = w
            n_out, n_in = codes.shape
            if codes.dtype == jnp.uint8:  # a byte's low half only: the masking's own cost
                codes = ((codes & 0x0F).astype(jnp.int32) - 8)
            wf = (codes.astype(jnp.float32).reshape(n_out, -1, 32) * scale[..., None]).reshape(
                n_out, n_in)
            return jnp.stack([jnp.dot(wf, r, precision=lax.Precision.HIGHEST) for r in x])
        if variant == "q4 halves":
            nibbles, scale = w
            n_out, half = nibbles.shape
            s_lo, s_hi = scale[:, :half // 32, None], scale[:, half // 32:, None]
            lo = (((nibbles & 0x0F).astype(jnp.int32) - 8).astype(jnp.float32).reshape(
                n_out, -1, 32) * s_lo).reshape(n_out, half)
            hi = (((nibbles >> 4).astype(jnp.int32) - 8).astype(jnp.float32).reshape(
                n_out, -1, 32) * s_hi).reshape(n_out, half)
            hp = lax.Precision.HIGHEST
            # the two products kept apart from their sum: fused with it, XLA widens one of
            # the halves into a buffer first
            return jnp.stack([sum(lax.optimization_barrier((jnp.dot(lo, r[:half], precision=hp),
                                                            jnp.dot(hi, r[half:], precision=hp))))
                              for r in x])
        if variant == "q4 via int8":
            nibbles, scale = w
            n_out = nibbles.shape[0]
            g = nibbles.reshape(n_out, -1, 1, 16)
            shift = lax.broadcasted_iota(jnp.uint8, (1, 1, 2, 1), 2) * 4
            codes = lax.optimization_barrier(
                (((g >> shift) & 0x0F).astype(jnp.int8) - 8).reshape(n_out, -1))
            wf = (codes.astype(jnp.float32).reshape(n_out, -1, 32) * scale[..., None]).reshape(
                n_out, -1)
            return jnp.stack([jnp.dot(wf, r, precision=lax.Precision.HIGHEST) for r in x])
        if variant.startswith("q4 bands"):
            planes, scale, offset = w
            half = planes.shape[0]
            bands = []
            for f in range(2):
                q = (((planes >> (4 * f)) & 0x0F).astype(jnp.int32) - 8).astype(jnp.float32)
                v = q.reshape(half, -1, 32) * scale[f * half:(f + 1) * half, :, None]
                if variant.endswith("offset"):
                    v = v + offset[f * half:(f + 1) * half, :, None]
                bands.append(v.reshape(half, -1))
            hp = lax.Precision.HIGHEST
            return jnp.stack([jnp.concatenate([jnp.dot(b, r, precision=hp) for b in bands])
                              for r in x])
        if variant == "q4 halves one dot":
            nibbles, scale = w
            n_out, half = nibbles.shape
            shift = lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1) * 4
            q = ((nibbles[:, None, :].astype(jnp.int32) >> shift) & 0x0F) - 8
            wf = (q.astype(jnp.float32).reshape(n_out, -1, 32) * scale[..., None]).reshape(
                n_out, 2 * half)
            return jnp.stack([jnp.dot(wf, r, precision=lax.Precision.HIGHEST) for r in x])
        if variant == "q4 factored":
            nibbles, scale = w
            n_out = nibbles.shape[0]
            g = nibbles.reshape(n_out, -1, 1, 16)
            shift = lax.broadcasted_iota(jnp.uint8, (1, 1, 2, 1), 2) * 4
            q = (((g >> shift) & 0x0F).astype(jnp.int32) - 8).astype(jnp.float32).reshape(
                n_out, -1, 32)
            parts = jnp.einsum("ogi,rgi->rog", q, x.reshape(x.shape[0], -1, 32),
                               precision=lax.Precision.HIGHEST)
            return jnp.sum(parts * scale[None], axis=-1)
        if int8:
            codes, scale = w
            return jnp.stack([jnp.dot(codes.astype(jnp.float32), r) * scale for r in x])
        if variant == "q4 shift i32":
            return jnp.stack([jnp.dot(widened(w), r, precision=lax.Precision.HIGHEST)
                              for r in x])
        if variant.endswith("reduce"):
            wf = widened(w) if q4 else w
            return jnp.stack([jnp.sum(wf * r[None, :], axis=1) for r in x])
        if q4:
            wf = widened(w)
            return jnp.stack([jnp.dot(wf, r, precision=lax.Precision.HIGHEST) for r in x])
        if f32 and out_first:
            if x.shape[0] <= MATVEC_ROWS:
                return jnp.stack([jnp.dot(w, r, precision=lax.Precision.HIGHEST) for r in x])
            return lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                   precision=lax.Precision.HIGHEST)
        if f32:
            return jnp.dot(x, w, precision=lax.Precision.HIGHEST)
        if not out_first:
            return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        if "trip" in variant:
            x = x.astype(jnp.bfloat16).astype(jnp.float32)
        else:
            x = lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        if "mat" in variant:
            x = jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)
        wf = w.astype(jnp.float32)
        return jnp.stack([jnp.dot(wf, r) for r in x])

    def norm(x):
        return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * norm_w

    def forward(x, layers, head):
        for qkv, o, gate_up, down in layers:
            a = linear(norm(x), qkv)
            x = x + linear(a[:, :HIDDEN], o)
            g = linear(norm(x), gate_up)
            x = x + linear(jax.nn.silu(g[:, :INTER]) * g[:, INTER:], down)
        return linear(norm(x), head)

    run = jax.jit(forward)
    x = jnp.ones((rows, HIDDEN), jnp.float32)
    for _ in range(3):
        run(x, layers, head).block_until_ready()
    times = []
    for _ in range(11):
        t0 = time.perf_counter()
        run(x, layers, head).block_until_ready()
        times.append(time.perf_counter() - t0)
    leaves = jax.tree_util.tree_leaves((layers, head))
    nbytes = sum(w.nbytes for w in leaves)
    params = sum(w.size * (2 if w.dtype == jnp.uint8 else 1 if w.dtype == jnp.int8
                           else 0 if q4 or int8 else 1) for w in leaves)
    return {"ms": statistics.median(times) * 1e3, "bytes": nbytes, "params": params}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,4", help="row counts, comma-separated")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated")
    ap.add_argument("--xla-flags", default="", help="';'-separated sets of XLA_FLAGS to add")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    variants = [v for v in args.variants.split(";") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {VARIANTS}")
    flag_sets = [""] + [f.strip() for f in args.xla_flags.split(";") if f.strip()]
    results: dict = {}
    for r in range(args.rounds):
        for flags in flag_sets:
            env = {**os.environ,
                   "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
            for variant in variants:
                for rows in rows_list:
                    out = subprocess.run([sys.executable, __file__, "--worker", variant,
                                          str(rows)], capture_output=True, text=True, env=env)
                    if out.returncode != 0:
                        res = {"ms": float("nan"), "bytes": 0, "params": 0,
                               "error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
                    else:
                        res = json.loads(out.stdout.strip().splitlines()[-1])
                    results.setdefault((flags, variant, rows), []).append(res)
                    print(f"round {r}: {variant}, {rows} rows {flags}: {res['ms']:.1f} ms "
                          f"{res.get('error', '')}", file=sys.stderr, flush=True)
    print(f"\nSmolLM2-135M's linears and tied head, XLA CPU, medians of {args.rounds} rounds: "
          f"ms, and GB/s of weights (GFLOP/s past {MATVEC_ROWS} rows)\n")
    head = "".join(f"{f'{n} rows':>18}" for n in rows_list)
    print(f"{'variant':<22}{'XLA flags':<40}{'MB':>6}{head}")
    for flags in flag_sets:
        for variant in variants:
            first = results[(flags, variant, rows_list[0])]
            cells, nbytes, params = [], max(x["bytes"] for x in first), max(
                x["params"] for x in first)
            for n in rows_list:
                ms = statistics.median(x["ms"] for x in results[(flags, variant, n)])
                rate = nbytes / ms / 1e6 if n <= MATVEC_ROWS else 2 * n * params / ms / 1e6
                cells.append(f"{ms:>9.1f} ({rate:>5.0f})")
            print(f"{variant:<22}{flags or '(none)':<40}{nbytes / 1e6:>6.0f}{''.join(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

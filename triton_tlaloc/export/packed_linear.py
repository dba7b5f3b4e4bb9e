"""GGUF-packed weights inside an entry's graph (`--weight-quant gguf`): a weight kept in its
GGUF type (export/gguf_packed.py's row bands) is widened to f32 where a product or the
embedding reads it, by a shift and a mask per plane, the same for every byte of a band, so XLA
fuses the widening into the reads of the product that consumes it: a matrix-vector product
per band of rows reads the packed bytes (docs/performance.md#4-bit-weights).

The values are gguf-py's, bit for bit: the codes are assembled as integers here, and
gguf_packed.values (the exporter's numpy uses it too) subtracts the zero, multiplies by the
scale and adds the offset once.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .gguf_packed import Layout, layout_of, values


def _parts(layout: Layout, w: dict, name: str) -> dict:
    return {sfx: w[name + sfx] for sfx, _, _ in layout.parts(1, 1)}


def _band_values(layout: Layout, parts: dict, r: int):
    """Band r's rows of a packed weight [rows, cols], as f32 [rows / bands, cols]."""
    n = parts[".scale"].shape[0] // layout.bands
    q = None
    for sfx, width in layout.planes:
        plane = parts[sfx]
        if width == 8:
            bits = plane[r * n:(r + 1) * n].astype(jnp.int32)
        else:
            per_field = layout.bands // (8 // width)  # bands a field of the plane holds
            f, start = r // per_field, (r % per_field) * n
            bits = plane[start:start + n] >> (width * f)
            if width * (f + 1) < 8:  # (the top field needs no mask)
                bits = bits & ((1 << width) - 1)
        q = bits if q is None else q | (bits << 4)
    band = slice(r * n, (r + 1) * n)
    return values(layout, q, parts[".scale"][band],
                  parts[".offset"][band] if layout.offset else None, jnp)


def weight_values(quant: str, w: dict, name: str):
    """A packed slot's f32 [rows, cols] from the entry's weights by slot name."""
    layout = layout_of(quant)
    parts = _parts(layout, w, name)
    bands = [_band_values(layout, parts, r) for r in range(layout.bands)]
    return bands[0] if len(bands) == 1 else jnp.concatenate(bands)


def packed_product(x, quant: str, w: dict, name: str, matvec_rows: int):
    """x [..., cols] times a packed slot's [rows, cols]ᵀ: [..., rows]. Up to `matvec_rows`
    rows of x, a matrix-vector product per row and band, each fused with its band's widening;
    more (a prompt), one product over the widened weight."""
    layout = layout_of(quant)
    parts = _parts(layout, w, name)
    lead, cols = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, cols)
    highest = lax.Precision.HIGHEST
    if flat.shape[0] <= matvec_rows:
        bands = [_band_values(layout, parts, r) for r in range(layout.bands)]
        out = jnp.stack([jnp.concatenate([jnp.dot(b, row, precision=highest) for b in bands])
                         for row in flat])
    else:
        out = lax.dot_general(flat, weight_values(quant, w, name), (((1,), (1,)), ((), ())),
                              precision=highest)
    return out.reshape(*lead, out.shape[-1])


def gathered_rows(quant: str, w: dict, name: str, ids):
    """Rows `ids` of a packed table (the embedding), f32 [*ids.shape, cols]: each array's rows
    gathered (a code plane's row ids % (rows / fields), shifted by its field), then widened."""
    layout = layout_of(quant)
    parts = _parts(layout, w, name)
    rows = parts[".scale"].shape[0]
    q = None
    for sfx, width in layout.planes:
        fields = 8 // width
        plane_rows = rows // fields
        got = jnp.take(parts[sfx], ids % plane_rows, axis=0)
        if width == 8:
            bits = got.astype(jnp.int32)
        else:
            shift = (width * (ids // plane_rows)).astype(jnp.uint8)[..., None]
            bits = ((got >> shift) & ((1 << width) - 1)).astype(jnp.int32)
        q = bits if q is None else q | (bits << 4)
    return values(layout, q, jnp.take(parts[".scale"], ids, axis=0),
                  jnp.take(parts[".offset"], ids, axis=0) if layout.offset else None, jnp)

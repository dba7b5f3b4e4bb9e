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

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from .gguf_packed import Layout, layout_of, values


def _parts(layout: Layout, w: dict, name: str) -> dict:
    return {sfx: w[name + sfx] for sfx, _, _ in layout.parts(1, 1)}


@dataclass(frozen=True)
class PackedShards:
    """How a tensor-parallel program's packed weight is divided over `devices`: along its rows
    (`pieces`, the row counts of one device's pieces, each banded on its own, for each device
    one after another: gguf_packed.PackedWeight.arrays), along its inputs (`by_inputs`, a
    row-parallel product), or not at all. Every array is viewed as [devices, rows, cols of a
    device], so the device axis is a whole axis of every operation: XLA's partitioner gives
    each device its own bands without moving a byte, and a row-parallel product's partial sums
    meet in one all-reduce after every band, not one per band."""

    devices: int = 1
    pieces: tuple[int, ...] | None = None  # None: one piece, a device's rows
    by_inputs: bool = False

    def view(self, a):
        """[rows, cols] as [devices, rows (of a device), cols (of a device)]."""
        if self.devices == 1:
            return a
        if self.by_inputs:
            return jnp.moveaxis(a.reshape(a.shape[0], self.devices, -1), 1, 0)
        return a.reshape(self.devices, -1, a.shape[-1])

    def unview(self, a):
        """view's inverse for [devices, rows, cols] values."""
        if self.devices == 1:
            return a
        if self.by_inputs:
            return jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1)
        return a.reshape(-1, a.shape[-1])


ONE_DEVICE = PackedShards()


def _bands(layout: Layout, parts: dict, sh: PackedShards) -> list:
    """Every band of every piece of a packed weight, f32 [(devices,) rows of the band, cols],
    in a device's row order."""
    planes = {sfx: sh.view(parts[sfx]) for sfx, _ in layout.planes}
    scale = sh.view(parts[".scale"])
    offset = sh.view(parts[".offset"]) if layout.offset else None
    out, row0 = [], 0  # the piece's first row on its device
    for piece in sh.pieces or (scale.shape[-2],):
        n = piece // layout.bands
        for r in range(layout.bands):
            q = None
            for sfx, width in layout.planes:
                plane = planes[sfx]
                if width == 8:
                    bits = plane[..., row0 + r * n:row0 + (r + 1) * n, :].astype(jnp.int32)
                else:
                    per_field = layout.bands // (8 // width)  # bands a field of the plane holds
                    f = r // per_field
                    start = row0 // (8 // width) + (r % per_field) * n
                    bits = plane[..., start:start + n, :] >> (width * f)
                    if width * (f + 1) < 8:  # (the top field needs no mask)
                        bits = bits & ((1 << width) - 1)
                q = bits if q is None else q | (bits << 4)
            band = slice(row0 + r * n, row0 + (r + 1) * n)
            out.append(values(layout, q, scale[..., band, :],
                              offset[..., band, :] if layout.offset else None, jnp))
        row0 += piece
    return out


def weight_values(quant: str, w: dict, name: str, sh: PackedShards = ONE_DEVICE):
    """A packed slot's f32 [rows, cols] from the entry's weights by slot name."""
    layout = layout_of(quant)
    bands = _bands(layout, _parts(layout, w, name), sh)
    return sh.unview(bands[0] if len(bands) == 1 else jnp.concatenate(bands, axis=-2))


def _matvec(bands: list, row, sh: PackedShards):
    """One row of x [cols] times every band: [rows]."""
    highest = lax.Precision.HIGHEST
    if sh.devices == 1 or not sh.by_inputs:  # [(devices,) n, cols] . [cols]
        out = jnp.concatenate([jnp.dot(b, row, precision=highest) for b in bands], axis=-1)
        return out.reshape(-1)
    # each device's inputs times its columns of every band, summed over the devices at the end
    x = row.reshape(sh.devices, -1)
    out = jnp.concatenate([jnp.einsum("dnc,dc->dn", b, x, precision=highest) for b in bands],
                          axis=-1)
    return jnp.sum(out, axis=0)


def packed_product(x, quant: str, w: dict, name: str, matvec_rows: int,
                   sh: PackedShards = ONE_DEVICE):
    """x [..., cols] times a packed slot's [rows, cols]ᵀ: [..., rows]. Up to `matvec_rows`
    rows of x, a matrix-vector product per row and band, each fused with its band's widening;
    more (a prompt), one product over the widened weight."""
    layout = layout_of(quant)
    parts = _parts(layout, w, name)
    lead, cols = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, cols)
    if flat.shape[0] <= matvec_rows:
        bands = _bands(layout, parts, sh)
        out = jnp.stack([_matvec(bands, row, sh) for row in flat])
    else:
        out = lax.dot_general(flat, weight_values(quant, w, name, sh), (((1,), (1,)), ((), ())),
                              precision=lax.Precision.HIGHEST)
    return out.reshape(*lead, out.shape[-1])


def packed_values(quant: str, parts: dict):
    """A packed weight's f32 values [..., rows, cols] from its arrays by suffix ("", ".high",
    ".scale", ".offset"), each with the same leading axes (a mixture's stacked experts, one
    expert of them, or a device's)."""
    return jnp.concatenate(_bands(layout_of(quant), parts, ONE_DEVICE), axis=-2)


def packed_matvec(quant: str, parts: dict, row):
    """packed_values times one row [cols]: [..., rows], a product per band fused with its
    band's widening."""
    return jnp.concatenate([jnp.einsum("...nc,c->...n", b, row, precision=lax.Precision.HIGHEST)
                            for b in _bands(layout_of(quant), parts, ONE_DEVICE)], axis=-1)


def gathered_rows(quant: str, w: dict, name: str, ids, devices: int = 1):
    """Rows `ids` of a packed table (the embedding), f32 [*ids.shape, cols]. A table split by
    vocabulary over `devices` (banded per device): each device gathers and widens the rows it
    holds (another device's row reads as zeros), and the rows meet in one all-reduce."""
    layout = layout_of(quant)
    parts = _parts(layout, w, name)
    if devices == 1:
        return _rows(layout, parts, ids)
    sh = PackedShards(devices)
    by_device = {sfx: sh.view(a) for sfx, a in parts.items()}
    rows = by_device[".scale"].shape[1]
    local = ids[None] - (jnp.arange(devices, dtype=ids.dtype) * rows).reshape(
        devices, *(1,) * ids.ndim)
    own = (local >= 0) & (local < rows)
    got = jax.vmap(lambda p, i: _rows(layout, p, i))(by_device, jnp.where(own, local, 0))
    # (a sum: a -0.0 reads +0.0, as when the partitioner sums a split f32 table's rows)
    return jnp.sum(jnp.where(own[..., None], got, 0.0), axis=0)


def _rows(layout: Layout, parts: dict, ids):
    """Rows `ids` of a table banded whole: a code plane of `fields` codes a byte holds row i in
    its row i % (rows / fields), shifted by width * (i // (rows / fields))."""
    rows = parts[".scale"].shape[0]
    q = None
    for sfx, width in layout.planes:
        plane_rows = rows // (8 // width)
        got = jnp.take(parts[sfx], ids % plane_rows, axis=0)
        if width == 8:
            bits = got.astype(jnp.int32)
        else:
            shift = (width * (ids // plane_rows)).astype(jnp.uint8)[..., None]
            bits = ((got >> shift) & ((1 << width) - 1)).astype(jnp.int32)
        q = bits if q is None else q | (bits << 4)
    return values(layout, q, jnp.take(parts[".scale"], ids, axis=0),
                  jnp.take(parts[".offset"], ids, axis=0) if layout.offset else None, jnp)

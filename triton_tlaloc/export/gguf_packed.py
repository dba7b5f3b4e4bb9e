"""GGUF's quantized tensors kept packed (`--weight-quant gguf`): each type's blocks taken
apart into one layout the graph can read, whatever the type, and read back to exactly gguf-py's
dequantized values, bit for bit in f32.

`pack` gives a `PackedWeight`, for a weight of `rows` x `cols` (cols along GGUF's blocks): the
unsigned code of each element (0 .. 2**bits - 1; Q8_0's signed), `scale` f32 [rows, cols /
group] and, for the types with a minimum, `offset` (the same shape); `zero`, an integer per
type subtracted from each code. An element is `scale * (code - zero)` (+ `offset`), the order
of operations gguf-py's: every product of a scale (an f16 times at most an 8-bit integer, exact
in f32) and a code is exact except Q6_K's, which is rounded once as in gguf-py, and the offset is
added once, so the result is the same whether or not a compiler fuses the two into an FMA.

What an artifact stores (`PackedWeight.arrays`, `Layout.parts`) packs the codes in row bands:
a plane of `fields` codes a byte holds rows / fields rows, and field f of plane row i is matrix
row f * rows / fields + i, its bits from f * width. The low 4 bits are a plane of two fields
(ui8 [rows / 2, cols]); a 5-bit type's fifth bits a plane of eight ([rows / 8, cols]), Q6_K's
two high bits one of four ([rows / 4, cols]); Q8_0's codes are int8 [rows, cols]. So each band
of rows reads its bytes with one shift and one mask, the same for every byte, along the
product's contracted axis: XLA's CPU code fuses that into a matrix-vector product at about
int8's speed, where two codes a byte along the contracted axis ran 10x slower
(docs/performance.md#4-bit-weights).

A tensor-parallel weight split along its rows (q|k|v, gate|up, a vocabulary-split table) is
banded piece by piece instead: each device's part of each fused part on its own, so a device's
shard of a plane holds whole bands and widens them with no bytes from another device
(`PackedWeight.arrays(pieces)`, packed_linear's `devices` and `pieces`).
Pure numpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

QK_K = 256  # the K types' super-block
PACKED_LAYOUT = "row-bands"  # the manifest's model.packedLayout: the codes in row bands

# GGUF type name: (elements per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def int4_type(group: int, zero_point: bool) -> str:
    """The packed type name of --weight-quant int4's codes ("INT4_G32", "INT4_ZP_G128")."""
    return f"INT4_{'ZP_' if zero_point else ''}G{group}"


@dataclass(frozen=True)
class Layout:
    """What a type's packed weight holds: the bits of a code, the elements per scale, the
    integer subtracted from each code and whether an offset is added."""

    bits: int
    group: int
    zero: int
    offset: bool

    @property
    def planes(self) -> list[tuple[str, int]]:
        """(suffix, bits a field) of each plane of codes: the low 4 bits, then the rest."""
        if self.bits == 8:
            return [("", 8)]
        return [("", 4)] + ([(".high", self.bits - 4)] if self.bits > 4 else [])

    @property
    def bands(self) -> int:
        """Row bands: the rows a byte's fields hold, at most (rows must divide by it)."""
        return max(8 // width for _, width in self.planes)

    def parts(self, rows: int, cols: int) -> list[tuple[str, str, tuple[int, int]]]:
        """(suffix, element type, shape) of each array an artifact stores for a weight of
        this type, the codes first (suffix "")."""
        if self.bits == 8:
            parts = [("", "i8", (rows, cols))]
        else:
            parts = [(sfx, "ui8", (rows // (8 // width), cols)) for sfx, width in self.planes]
        parts.append((".scale", "f32", (rows, cols // self.group)))
        if self.offset:
            parts.append((".offset", "f32", (rows, cols // self.group)))
        return parts


LAYOUTS = {"Q4_0": Layout(4, 32, 8, False), "Q4_1": Layout(4, 32, 0, True),
           "Q5_0": Layout(5, 32, 16, False), "Q5_1": Layout(5, 32, 0, True),
           "Q8_0": Layout(8, 32, 0, False), "Q4_K": Layout(4, 32, 0, True),
           "Q5_K": Layout(5, 32, 0, True), "Q6_K": Layout(6, 16, 32, False),
           # --weight-quant int4 of a full-precision checkpoint (quant.quantize_int4): a scale
           # per group, symmetric (codes 0 .. 15 about 8) or with an offset (a zero point)
           **{int4_type(group, zp): Layout(4, group, 0 if zp else 8, zp)
              for group in (32, 128) for zp in (False, True)}}


# A weight fused from tensors of different types, or stacked over layers of different types
# (a Q4_K_M file's q|k|v, its ffn_down), takes one layout all of them fit: "B6_G16_Z32_O"; an
# AWQ or GPTQ linear is "B4_G128_Z0_O" (hf_packed).
_MIXED = re.compile(r"B([4568])_G(16|32|64|128)_Z(\d+)(_O)?")


def layout_of(quant: str | None) -> Layout | None:
    """The layout a weight slot's quant names: a type's (LAYOUTS), a mixed one, or None (not
    packed: int8, fp8 or none)."""
    if quant in LAYOUTS:
        return LAYOUTS[quant]
    m = _MIXED.fullmatch(quant or "")
    return None if m is None else Layout(int(m[1]), int(m[2]), int(m[3]), bool(m[4]))


def is_packed(quant: str | None) -> bool:
    """Whether a weight slot's quant names a packed layout (not int8 or fp8)."""
    return layout_of(quant) is not None


def mixed_type(types: list[str]) -> str:
    """One layout for weights of these types (GGUF's or mixed): the largest zero (so every
    code, less its own type's zero, stays non-negative), the bits that hold every type's codes
    from there, the smallest group (a larger one's scales repeated), an offset when any has
    one (zero for the others). With Q8_0 among them: signed 8-bit codes, each its own type's
    code less its zero (llama.cpp writes a Q4_K_M file's attn_v as Q8_0 where a row is not
    whole super-blocks, beside Q5_0 q and k)."""
    layouts = [layout_of(t) for t in types]
    if len(set(types)) == 1:
        return types[0]
    zero = max(lay.zero for lay in layouts)
    top = max(zero + (1 << lay.bits) - 1 - lay.zero for lay in layouts)
    bits = next((b for b in (4, 5, 6) if top < 1 << b), None)
    if any(lay.bits == 8 for lay in layouts) or bits is None:
        bits, zero = 8, 0  # every type's code less its zero is within -128 .. 127
    group = min(lay.group for lay in layouts)
    return f"B{bits}_G{group}_Z{zero}{'_O' if any(lay.offset for lay in layouts) else ''}"


@dataclass
class PackedWeight:
    qtype: str
    shape: tuple[int, int]  # rows, cols
    bits: int
    group: int  # elements per scale
    zero: int  # subtracted from each code
    codes: np.ndarray  # uint8 [rows, cols] (int8 for Q8_0)
    scale: np.ndarray  # f32 [rows, cols / group]
    offset: np.ndarray | None = None  # f32 [rows, cols / group], added last

    @property
    def layout(self) -> Layout:
        return layout_of(self.qtype)

    def as_type(self, quant: str) -> PackedWeight:
        """The same values in another layout (mixed_type's): each code less its zero plus the
        new one, scales and offsets repeated for a smaller group, a zero offset where there was
        none (a value of -0.0 then reads +0.0)."""
        if quant == self.qtype:
            return self
        new = layout_of(quant)
        codes = self.codes.astype(np.int32) - self.zero + new.zero
        low, high = (-128, 127) if new.bits == 8 else (0, (1 << new.bits) - 1)
        assert low <= codes.min() and codes.max() <= high, (self.qtype, quant)
        repeat = self.group // new.group
        scale = np.repeat(self.scale, repeat, axis=1)
        offset = None if not new.offset else (
            np.zeros_like(scale) if self.offset is None else np.repeat(self.offset, repeat, 1))
        return PackedWeight(quant, self.shape, new.bits, new.group, new.zero,
                            codes.astype(np.int8 if new.bits == 8 else np.uint8), scale, offset)

    @property
    def nbytes(self) -> int:
        """The bytes an artifact stores for it."""
        return sum(a.nbytes for a in self.arrays().values())

    def arrays(self, pieces: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        """The arrays an artifact stores, by suffix, in Layout.parts' order: the codes in row
        bands (the module's docstring), the scales and offsets by row. `pieces`: row counts
        that add up to the rows, each banded on its own (a tensor-parallel weight split along
        its rows: each device's part of each fused part; default one piece)."""
        rows, cols = self.shape
        pieces = pieces or (rows,)
        assert sum(pieces) == rows, (pieces, rows)
        for n in pieces:
            if n % self.layout.bands:
                raise PackError(f"{self.qtype}: {n} rows do not divide into the "
                                f"{self.layout.bands} bands of its packed layout")
        out = {}
        for sfx, width in self.layout.planes:
            if width == 8:
                out[sfx] = self.codes.astype(np.int8)
                continue
            fields = 8 // width
            bits = (self.codes.astype(np.uint8) >> (0 if sfx == "" else 4)) & ((1 << width) - 1)
            banded, start = [], 0
            for n in pieces:
                bands = bits[start:start + n].reshape(fields, n // fields, cols)
                banded.append(np.bitwise_or.reduce(
                    bands << (width * np.arange(fields, dtype=np.uint8))[:, None, None], axis=0))
                start += n
            out[sfx] = np.concatenate(banded)
        out[".scale"] = self.scale
        if self.offset is not None:
            out[".offset"] = self.offset
        return out

    def take_rows(self, order: np.ndarray) -> PackedWeight:
        """The weight with its rows in `order` (blocks run along a row, so rows move whole)."""
        pick = {k: None if a is None else a[order] for k, a in vars(self).items()
                if isinstance(a, np.ndarray)}
        return PackedWeight(**{**vars(self), **pick, "shape": (len(order), self.shape[1])})


def stack_rows(parts: list[PackedWeight], what: str, quant: str | None = None) -> PackedWeight:
    """Weights, their rows one after another (q|k|v, gate|up fused), in `quant`'s layout
    (default: mixed_type of theirs)."""
    quant = quant or mixed_type([p.qtype for p in parts])
    parts = [p.as_type(quant) for p in parts]
    if len({p.shape[1] for p in parts}) != 1:
        raise PackError(f"{what}: fused rows of different lengths")
    first = parts[0]
    joined = {k: np.concatenate([getattr(p, k) for p in parts]) for k, a in vars(first).items()
              if isinstance(a, np.ndarray)}
    return PackedWeight(**{**vars(first), **joined,
                           "shape": (sum(p.shape[0] for p in parts), first.shape[1])})


class PackError(ValueError):
    pass


def pack(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """A GGUF tensor's bytes (uint8, its blocks in order, `shape` = rows x cols) packed."""
    if qtype not in BLOCKS:
        raise PackError(f"GGUF type {qtype} is not kept packed (kept: {', '.join(BLOCKS)}; "
                        f"--weight-quant f32 widens any type)")
    rows, cols = shape
    per_block, size = BLOCKS[qtype]
    if cols % per_block:
        raise PackError(f"{qtype}: a row of {cols} elements is not whole blocks of {per_block}")
    blocks = np.ascontiguousarray(raw, np.uint8).reshape(rows * cols // per_block, size)
    codes, scale, offset, zero, bits, group = _READERS[qtype](blocks)
    assert LAYOUTS[qtype] == Layout(bits, group, zero, offset is not None), qtype
    return PackedWeight(qtype, (rows, cols), bits, group, zero, codes.reshape(rows, cols),
                        scale.reshape(rows, cols // group).astype(np.float32),
                        None if offset is None else offset.reshape(rows, cols // group)
                        .astype(np.float32))


def dequantize(p: PackedWeight, xp=np):
    """The f32 values of a packed weight, computed with `xp` (numpy, or jax.numpy in a graph):
    equal to gguf-py's dequantization bit for bit."""
    return values(p.layout, p.codes, p.scale, p.offset, xp)


def values(layout: Layout, codes, scale, offset=None, xp=np):
    """The f32 values [..., cols] of integer codes [..., cols] of a layout, with their groups'
    scales (and offsets) [..., cols / group], in gguf-py's order of operations: the code less
    the zero (exact in f32, an integer below 2**24), times the scale, plus the offset once.
    The exporter's numpy and the programs' graphs (packed_linear) both compute them here."""
    lead, groups = codes.shape[:-1], scale.shape[-1]
    q = (xp.asarray(codes).astype(xp.float32) - layout.zero).reshape(*lead, groups,
                                                                      layout.group)
    value = xp.asarray(scale)[..., None] * q
    if layout.offset:
        value = value + xp.asarray(offset)[..., None]
    return value.reshape(*lead, groups * layout.group)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _split_nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes whose low halves hold `run` elements and high halves the next `run` (per run),
    as codes in order."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _read_q4_0(b):
    return _split_nibbles(b[:, 2:], 16), _f16(b[:, :2]), None, 8, 4, 32


def _read_q4_1(b):
    return _split_nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 4, 32


def _bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits of a block (a little-endian uint32), element i's at bit i."""
    h = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1)
    return ((h >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _read_q5_0(b):
    codes = _split_nibbles(b[:, 6:], 16) | (_bits_32(b[:, 2:6]) << 4)
    return codes, _f16(b[:, :2]), None, 16, 5, 32


def _read_q5_1(b):
    codes = _split_nibbles(b[:, 8:], 16) | (_bits_32(b[:, 4:8]) << 4)
    return codes, _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 5, 32


def _read_q8_0(b):
    codes = np.ascontiguousarray(b[:, 2:]).view(np.int8)
    return codes, _f16(b[:, :2]), None, 0, 8, 32


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's f32 scale and offset of each 32 (gguf-py's d * sc and -(dmin * m))."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    ds, ms, mds = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([ds & 0x3F, (mds & 0x0F) | ((ds >> 2) & 0x30)], axis=-1)
    m = np.concatenate([ms & 0x3F, (mds >> 4) | ((ms >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _read_q4_k(b):
    scale, offset = _k_scales(b)
    return _split_nibbles(b[:, 16:], 32), scale, offset, 0, 4, 32


def _read_q5_k(b):
    n = b.shape[0]
    scale, offset = _k_scales(b)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _split_nibbles(b[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
    return codes, scale, offset, 0, 5, 32


def _read_q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    low = _split_nibbles(ql.reshape(n, -1), 64)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = low | ((high & 3).reshape(n, -1) << 4)
    return codes, _f16(b[:, 208:210]) * scales, None, 32, 6, 16


_READERS = {"Q4_0": _read_q4_0, "Q4_1": _read_q4_1, "Q5_0": _read_q5_0, "Q5_1": _read_q5_1,
            "Q8_0": _read_q8_0, "Q4_K": _read_q4_k, "Q5_K": _read_q5_k, "Q6_K": _read_q6_k}

__all__ = ["BLOCKS", "LAYOUTS", "Layout", "PACKED_LAYOUT", "PackError", "PackedWeight", "dequantize", "is_packed",
           "pack", "int4_type", "layout_of", "mixed_type", "stack_rows", "values"]

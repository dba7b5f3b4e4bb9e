"""GGUF's quantized tensors kept packed (the first step of `--weight-quant gguf`): each type's
blocks taken apart into one layout the graph can read, whatever the type, and read back to
exactly gguf-py's dequantized values, bit for bit in f32.

The layout (`PackedWeight`), for a weight of `rows` x `cols` (cols along GGUF's blocks):

- codes: the unsigned integer of each element (0 .. 2**bits - 1), stored as
  - `nibbles` uint8 [rows, cols / 2], the low 4 bits: in each group of 32 elements, byte i
    holds element i in its low half and element i + 16 in its high half (Q4_0's own order);
  - `high` uint8, the bits above 4 for 5- and 6-bit types: [rows, cols / 8] with element
    8k + i's fifth bit at bit i of byte k, or [rows, cols / 4] with element 4k + i's two bits
    at bits 2i, 2i + 1;
  - or `codes8` int8 [rows, cols] for Q8_0 (its codes are signed);
- `scale` f32 [rows, cols / group] and, for the types with a minimum, `offset` (the same
  shape); `zero`, an integer per type subtracted from each code.

An element is `scale * (code - zero)` (+ `offset` for the types that have one), the order of
operations gguf-py's: every product of a scale (an f16 times at most an 8-bit integer, exact in
f32) and a code is exact except Q6_K's, which is rounded once as in gguf-py, and the offset is
added once, so the result is the same whether or not a compiler fuses the two into an FMA.
Pure numpy; `dequantize(packed, xp)` runs the same code under jax.numpy inside a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # the K types' super-block

# GGUF type name: (elements per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass
class PackedWeight:
    qtype: str
    shape: tuple[int, int]  # rows, cols
    bits: int
    group: int  # elements per scale
    zero: int  # subtracted from each code
    scale: np.ndarray  # f32 [rows, cols / group]
    offset: np.ndarray | None = None  # f32 [rows, cols / group], added last
    nibbles: np.ndarray | None = None  # uint8 [rows, cols / 2]
    high: np.ndarray | None = None  # uint8 [rows, cols / 8] (5 bits) or [rows, cols / 4] (6)
    codes8: np.ndarray | None = None  # int8 [rows, cols] (Q8_0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.scale, self.offset, self.nibbles, self.high,
                                      self.codes8) if a is not None)


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
    codes = codes.reshape(rows, cols)
    out = PackedWeight(qtype, (rows, cols), bits, group, zero,
                       scale.reshape(rows, cols // group).astype(np.float32),
                       None if offset is None else offset.reshape(rows, cols // group)
                       .astype(np.float32))
    if bits == 8:
        out.codes8 = codes.astype(np.int8)
        return out
    out.nibbles = _nibbles(codes & 0x0F)
    if bits == 5:
        out.high = np.packbits((codes >> 4).astype(np.uint8).reshape(rows, -1, 8), axis=-1,
                               bitorder="little").reshape(rows, cols // 8)
    elif bits == 6:
        two = (codes >> 4).astype(np.uint8).reshape(rows, -1, 4)
        out.high = (two[..., 0] | two[..., 1] << 2 | two[..., 2] << 4 | two[..., 3] << 6)
    return out


def dequantize(p: PackedWeight, xp=np):
    """The f32 values of a packed weight, computed with `xp` (numpy, or jax.numpy in a graph):
    equal to gguf-py's dequantization bit for bit."""
    rows, cols = p.shape
    f32 = xp.float32
    if p.codes8 is not None:
        q = xp.asarray(p.codes8).astype(f32)
    else:
        nib = xp.asarray(p.nibbles).reshape(rows, cols // 32, 1, 16)
        q = xp.concatenate([nib & 0x0F, nib >> 4], axis=2).reshape(rows, cols).astype(xp.int32)
        if p.bits == 5:
            h = xp.asarray(p.high).reshape(rows, cols // 8, 1)
            shifts = xp.arange(8, dtype=xp.uint8).reshape(1, 1, 8)
            q = q | (((h >> shifts) & 1).reshape(rows, cols).astype(xp.int32) << 4)
        elif p.bits == 6:
            h = xp.asarray(p.high).reshape(rows, cols // 4, 1)
            shifts = (2 * xp.arange(4, dtype=xp.uint8)).reshape(1, 1, 4)
            q = q | (((h >> shifts) & 3).reshape(rows, cols).astype(xp.int32) << 4)
        q = (q - p.zero).astype(f32)
    groups = q.reshape(rows, cols // p.group, p.group)
    value = xp.asarray(p.scale)[..., None] * groups
    if p.offset is not None:
        value = value + xp.asarray(p.offset)[..., None]
    return value.reshape(rows, cols)


def _nibbles(low: np.ndarray) -> np.ndarray:
    """4-bit codes [rows, cols] into bytes: in each 32, element i low and i + 16 high."""
    rows, cols = low.shape
    g = low.astype(np.uint8).reshape(rows, cols // 32, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(rows, cols // 2)


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

__all__ = ["BLOCKS", "PackError", "PackedWeight", "dequantize", "pack"]

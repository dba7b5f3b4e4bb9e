"""Weight quantization at export (docs/design.md#quantization): each layer's
linear weights as codes with one f32 scale per output channel (int8, fp8), or as 4-bit codes
with a scale per group (int4, packed as gguf_packed packs a GGUF file's blocks). Pure numpy.

    int8: scale[o] = max_i |W[o, i]| / 127, code = clamp(round_half_even(W / scale), -127, 127)
    fp8:  scale[o] = max_i |W[o, i]| / 448, code = W / scale rounded to nearest even e4m3fn

A row of zeros gets scale 1. Computed in f32 from the checkpoint's values. The graph widens the
codes in front of each product (exact) and multiplies each output column by its scale.

    int4, per group of `group` inputs (round to nearest, halves to even):
      symmetric:  scale = f16(max |W| / 7), code = clamp(round(W / scale), -8, 7) + 8
      zero point: scale = f16((max W - min W) / 15), offset = f16(min W),
                  code = clamp(round((W - offset) / scale), 0, 15)
    value = scale * (code - 8), or scale * code + offset

Scales and offsets are rounded to f16 values (kept in f32), as GGUF's are: every product of a
scale and a code is then exact in f32, so the values do not depend on how a compiler orders or
fuses the arithmetic. A group of zeros (or of equal values, with a zero point) gets scale 1.
"""

from __future__ import annotations

import numpy as np

# --weight-quant name -> (element type of the codes, the largest code)
QUANT_FORMATS = {"int8": ("i8", 127.0), "fp8": ("f8E4M3FN", 448.0)}


def code_dtype(quant: str) -> str:
    return QUANT_FORMATS[quant][0]


def quantize_rows(w: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [..., out, in], scale [..., out] f32) of a weight in [out, in] layout (a stack
    of them too: a mixture's experts, each row its own scale)."""
    from ..artifact.manifest import numpy_dtype

    dtype, top = QUANT_FORMATS[quant]
    w = np.asarray(w, dtype=np.float32)
    peak = np.max(np.abs(w), axis=-1)
    scale = np.where(peak > 0, peak / np.float32(top), np.float32(1.0)).astype(np.float32)
    scaled = np.clip(w / scale[..., None], -top, top)
    if quant == "int8":
        codes = np.rint(scaled).astype(np.int8)  # rint rounds half to even
    else:  # ml_dtypes rounds to nearest even; the clip keeps a rounding up of 448 finite
        codes = scaled.astype(numpy_dtype(dtype))
    return codes, scale


def quantize_int4(w: np.ndarray, group: int, zero_point: bool):
    """A weight [out, in] as int4 codes (gguf_packed.PackedWeight, type int4_type(group,
    zero_point)); `in` must be whole groups."""
    from .gguf_packed import PackError, PackedWeight, int4_type

    rows, cols = w.shape
    if cols % group:
        raise PackError(f"a row of {cols} inputs is not whole groups of {group} "
                        f"(--quant-group 32 divides more)")
    g = np.asarray(w, np.float32).reshape(rows, cols // group, group)
    if zero_point:
        low, high = g.min(axis=-1), g.max(axis=-1)
        offset = low.astype(np.float16).astype(np.float32)
        scale = _f16_scale((high - offset) / np.float32(15))
        codes = np.clip(np.rint((g - offset[..., None]) / scale[..., None]), 0, 15)
    else:
        scale = _f16_scale(np.abs(g).max(axis=-1) / np.float32(7))
        offset = None
        codes = np.clip(np.rint(g / scale[..., None]), -8, 7) + 8
    return PackedWeight(int4_type(group, zero_point), (rows, cols), 4, group,
                        0 if zero_point else 8, codes.reshape(rows, cols).astype(np.uint8),
                        scale, offset)


def _f16_scale(step: np.ndarray) -> np.ndarray:
    """Steps rounded to f16 values (f32 arrays): 1 where there is no step, never zero."""
    rounded = step.astype(np.float16).astype(np.float32)
    return np.where(step > 0, np.maximum(rounded, np.float32(2 ** -24)), np.float32(1))


def dequantize_rows(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The f32 weight the graph computes with: codes widened, times each row's scale."""
    return codes.astype(np.float32) * scale[..., None].astype(np.float32)

"""Weight quantization at export (docs/design.md#quantization): each layer's
linear weights as codes with one f32 scale per output channel. Pure numpy.

    int8: scale[o] = max_i |W[o, i]| / 127, code = clamp(round_half_even(W / scale), -127, 127)
    fp8:  scale[o] = max_i |W[o, i]| / 448, code = W / scale rounded to nearest even e4m3fn

A row of zeros gets scale 1. Computed in f32 from the checkpoint's values. The graph widens the
codes in front of each product (exact) and multiplies each output column by its scale.
"""

from __future__ import annotations

import numpy as np

# --weight-quant name -> (element type of the codes, the largest code)
QUANT_FORMATS = {"int8": ("i8", 127.0), "fp8": ("f8E4M3FN", 448.0)}


def code_dtype(quant: str) -> str:
    return QUANT_FORMATS[quant][0]


def quantize_rows(w: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [out, in], scale [out] f32) of a weight in [out, in] layout."""
    from ..artifact.manifest import numpy_dtype

    dtype, top = QUANT_FORMATS[quant]
    w = np.asarray(w, dtype=np.float32)
    peak = np.max(np.abs(w), axis=1)
    scale = np.where(peak > 0, peak / np.float32(top), np.float32(1.0)).astype(np.float32)
    scaled = np.clip(w / scale[:, None], -top, top)
    if quant == "int8":
        codes = np.rint(scaled).astype(np.int8)  # rint rounds half to even
    else:  # ml_dtypes rounds to nearest even; the clip keeps a rounding up of 448 finite
        codes = scaled.astype(numpy_dtype(dtype))
    return codes, scale


def dequantize_rows(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The f32 weight the graph computes with: codes widened, times each row's scale."""
    return codes.astype(np.float32) * scale[:, None].astype(np.float32)

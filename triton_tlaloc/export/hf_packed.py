"""AWQ and GPTQ checkpoints' 4-bit linears (a Hugging Face config's `quantization_config` with
`quant_method` "awq" or "gptq") taken apart into gguf_packed's PackedWeight, as they are: the
codes, a scale per group and the group's zero point, never widened (`--weight-quant awq|gptq`;
without it HfCheckpoint reads such a linear as its values).

The formats (a linear of `out` x `in`, groups of `group` inputs; words are int32, a code four
bits of a word, code j of a word at bits 4j):

- AWQ (AutoAWQ's GEMM layout, `version` "gemm"): `qweight` [in, out / 8] and `qzeros`
  [in / group, out / 8] pack eight outputs a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (code j of
  a word is output AWQ_ORDER[j] of its eight); `scales` f16 [in / group, out].
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq"): `qweight` [in / 8, out] packs eight
  inputs a word in order; `qzeros` [in / group, out / 8] eight outputs a word in order, each
  stored one less than the zero it means (the "gptq" format's offset; "gptq_v2" stores the zero
  itself); `scales` f16 [in / group, out]; `g_idx` [in], each input's group, which must be
  input // group (`desc_act` reorders them, and is refused by name).

A value is `scale * (code - zero)`. Stored as `scale * code + offset` with
`offset = -(scale * zero)`: both products are exact in f32 (an f16 times an integer below 16),
so their sum is the exact value, rounded once, the same value (q - z) * s gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_packed import PackedWeight, PackError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class HfQuant:
    method: str  # "awq" | "gptq"
    group: int
    zero_offset: int  # added to a stored zero: 1 for GPTQ's "gptq" format, else 0


def hf_quant(config: dict) -> HfQuant | None:
    """The AWQ/GPTQ quantization a config declares, checked; None for a config without one
    (or with another method, which config_from_hf judges). Refused by name: bits other than 4,
    a group not in GROUPS, GPTQ's desc_act, AWQ other than its GEMM layout."""
    q = config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method not in ("awq", "gptq"):
        return None
    what = f"quantization_config ({method})"
    if q.get("bits", q.get("w_bit")) != 4:
        raise PackError(f"{what}: bits {q.get('bits', q.get('w_bit'))} (4 are read)")
    group = q.get("group_size", q.get("q_group_size"))
    if group not in GROUPS:
        raise PackError(f"{what}: group_size {group} (read: {', '.join(map(str, GROUPS))})")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise PackError(f"{what}: version {version!r} (the GEMM layout is read)")
        if q.get("zero_point") is False:
            raise PackError(f"{what}: zero_point false (AWQ with zero points is read)")
        return HfQuant("awq", group, 0)
    if q.get("desc_act"):
        raise PackError(f"{what}: desc_act true (inputs reordered by g_idx are not read)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise PackError(f"{what}: checkpoint_format {fmt!r} (gptq and gptq_v2 are read)")
    return HfQuant("gptq", group, 1 if fmt == "gptq" else 0)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., n] as their eight 4-bit codes in word order, uint8 [..., n, 8]."""
    w = np.ascontiguousarray(words).view(np.uint32)[..., None]
    return ((w >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8)


def _along_out(words: np.ndarray, awq: bool) -> np.ndarray:
    """Words packing eight outputs each, [rows, out / 8], as codes [rows, out]."""
    codes = _nibbles(words)
    if awq:  # code j of a word is output AWQ_ORDER[j]
        codes = codes[..., np.argsort(AWQ_ORDER)]
    return codes.reshape(words.shape[0], -1)


def unpack(spec: HfQuant, qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray,
           g_idx: np.ndarray | None = None, what: str = "a linear") -> PackedWeight:
    """A linear's tensors as a PackedWeight [out, in] (type B4_G<group>_Z0_O)."""
    scales = np.asarray(scales)
    groups, out = scales.shape
    if spec.method == "awq":
        codes = _along_out(qweight, True).T  # [in, out] -> [out, in]
    else:
        codes = _nibbles(qweight).transpose(0, 2, 1).reshape(-1, out).T  # [in / 8, out]
        if g_idx is not None and not np.array_equal(
                np.asarray(g_idx), np.arange(codes.shape[1]) // spec.group):
            raise PackError(f"{what}: g_idx is not input // group_size (reordered inputs)")
    rows, cols = codes.shape
    if cols != groups * spec.group or rows != out:
        raise PackError(f"{what}: qweight {list(qweight.shape)}, scales {list(scales.shape)} "
                        f"and group_size {spec.group} do not agree")
    zeros = _along_out(qzeros, spec.method == "awq").astype(np.float32) + spec.zero_offset
    scale = scales.astype(np.float32).T  # [out, in / group], f16 values
    offset = -(scale * zeros.T)  # exact: an f16 times an integer below 17
    return PackedWeight(f"B4_G{spec.group}_Z0_O", (rows, cols), 4, spec.group, 0,
                        np.ascontiguousarray(codes), np.ascontiguousarray(scale),
                        np.ascontiguousarray(offset))

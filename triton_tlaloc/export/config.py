"""A checkpoint's config read into a DecoderConfig: the model's shape and its family's switches
(rotary scaling, windows, norms, the linear-attention layers of a hybrid), each unsupported
setting refused by name (CheckpointError). Hugging Face's config.json and a GGUF file's metadata
both end here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

FAMILIES = ("llama", "qwen3", "mistral", "gemma3_text", "qwen3_5_text", "qwen3_moe", "mixtral",
            "qwen3_5_moe_text")
HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text")  # Gated DeltaNet layers among attention ones
# Mixtures of experts whose MLP (or attention) the graph lacks: refused with what is missing
MOE_NOT_SERVED = {
    "qwen2_moe": "q/k/v biases",
    "olmoe": "q and k RMSNorm over the whole projection",
    "gpt_oss": "attention sinks, biased experts and its clamped SwiGLU",
    "deepseek_v2": "multi-head latent attention and grouped routing",
    "deepseek_v3": "multi-head latent attention and grouped routing",
}
# A multimodal checkpoint whose text decoder is one of FAMILIES: its config's text_config is the
# decoder's, and its tensors carry a prefix (the vision tower's are not read).
TEXT_OF_MULTIMODAL = {"qwen3_5": ("qwen3_5_text", "model.language_model."),
                      "qwen3_5_moe": ("qwen3_5_moe_text", "model.language_model.")}
GGUF_FAMILIES = ("llama", "qwen3", "qwen3moe")  # GGUF's architecture names
FAMILY_OF_GGUF = {"qwen3moe": "qwen3_moe"}  # where GGUF's name is not the family's


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
class Experts:
    """A mixture of experts in place of the MLP on `layers` (qwen3_moe, mixtral, qwen3_5_moe):
    a router [experts, hidden] whose softmax's `top_k` largest choose each token's experts, their
    weights renormalized to sum to 1 when `norm_topk_prob`; each expert a gated MLP of
    `intermediate_size` channels. The other layers keep the dense MLP."""

    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # qwen3_5_moe: a shared expert beside the routed ones, a gated MLP of this many channels
    # whose output is added times sigmoid(its gate [1, hidden] . x); 0: none
    shared_intermediate_size: int = 0

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "numExperts": self.num_experts,
                "topK": self.top_k, "intermediateSize": self.intermediate_size,
                "normTopkProb": self.norm_topk_prob,
                "sharedIntermediateSize": self.shared_intermediate_size}


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
    moe: Experts | None = None  # qwen3_moe, mixtral: the layers whose MLP is experts

    def is_linear(self, layer: int) -> bool:
        return self.linear is not None and layer in self.linear.layers

    def is_sparse(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.layers

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
    dequantized as it is read; AWQ and GPTQ ones are read by export/hf_packed.py; any other
    quantization is refused by name. None: per-tensor or per-row scales (or no quantization,
    or AWQ/GPTQ)."""
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get(
        "quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method in ("awq", "gptq"):
        return None
    if method != "fp8":
        raise CheckpointError(f"quantization_config quant_method {method!r} is not supported "
                              f"(fp8 checkpoints are dequantized, AWQ and GPTQ read; export an "
                              f"unquantized checkpoint with --weight-quant instead)")
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
    gemma, qwen35 = family == "gemma3_text", family in HYBRIDS
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
        intermediate_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
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
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe", *HYBRIDS),
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
        moe=_experts(cfg, layers),
    )


def _experts(cfg: dict, layers: int) -> Experts | None:
    """A mixture of experts' layers and shapes: qwen3_moe's on every decoder_sparse_step-th
    layer not in mlp_only_layers (transformers' rule), mixtral's and qwen3_5_moe's on every
    layer."""
    family = cfg["model_type"]
    if family == "qwen3_5_moe_text":  # every layer, renormalized, with a shared expert
        return Experts(tuple(range(layers)), int(cfg["num_experts"]),
                       int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]), True,
                       int(cfg["shared_expert_intermediate_size"]))
    if family == "mixtral":
        return Experts(tuple(range(layers)), int(cfg["num_local_experts"]),
                       int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]), True)
    # (the Hub's configs say num_experts; transformers 5 writes num_local_experts)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if family != "qwen3_moe" or not experts:
        return None
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    moe = Experts(tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
                  experts, int(cfg["num_experts_per_tok"]),
                  int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", True)))
    if not 0 < moe.top_k <= moe.num_experts:
        raise CheckpointError(f"num_experts_per_tok {moe.top_k} of {moe.num_experts} experts")
    return moe if moe.layers else None


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
    if family in MOE_NOT_SERVED:
        raise CheckpointError(f"model_type {family!r}: a mixture of experts this exporter does "
                              f"not serve yet; missing: {MOE_NOT_SERVED[family]} (served: "
                              f"qwen3_moe, mixtral, qwen3_5_moe)")
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
                                       ("mistral", "mixtral") else ["full_attention"] * layers)
    kinds = ("sliding_attention", "full_attention") + (
        ("linear_attention",) if family in HYBRIDS else ())
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

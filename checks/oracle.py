"""transformers as the oracle: seeded tiny random checkpoints, greedy ids and last-token logits.

torch and transformers are test oracles here, never part of the serving path.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch


def make_config(family: str, common: dict, layers: int):
    """qwen3_5_text: three Gated DeltaNet layers then a gated attention layer (the family's
    pattern), per pair of layers asked for: 4 layers by default. Partial rotary: 8 of 16 dims
    rotate."""
    from transformers import Qwen3_5TextConfig

    assert family == "qwen3_5_text", family
    return Qwen3_5TextConfig(**{**common, "num_hidden_layers": max(4, 2 * layers)},
                             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})


def make_tiny_checkpoint(out: Path, family: str, *, layers: int = 2, tied: bool = False,
                         seed: int = 0, save_dtype=torch.float32) -> Path:
    """A seeded random model built with transformers and saved as a Hugging Face checkpoint.
    initializer_range 0.2 makes its logits peaked enough that greedy ids are a stable check."""
    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              Qwen3Config)

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tied, initializer_range=0.2, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0)
    elif family == "qwen3":
        # head_dim 32 is not hidden / heads: the exporter must read it from the config.
        cfg = Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    elif family == "mistral":
        cfg = MistralConfig(**common, head_dim=16, rope_theta=10000.0, sliding_window=8)
    elif family == "gemma3_text":
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        cfg = Gemma3TextConfig(**{**common, "num_hidden_layers": len(types)}, head_dim=16,
                               sliding_window=8, layer_types=types, query_pre_attn_scalar=24,
                               rope_parameters={
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    elif family == "qwen3_5_text":
        cfg = make_config(family, common, layers)
    elif family == "qwen3_moe":
        # 5 experts, top 2, renormalized; a dense layer between two sparse ones
        from transformers import Qwen3MoeConfig
        cfg = Qwen3MoeConfig(**{**common, "num_hidden_layers": max(3, layers)}, head_dim=32,
                             rope_theta=1000000.0, num_experts=5, num_experts_per_tok=2,
                             moe_intermediate_size=64, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[1])
    elif family == "qwen3_5_moe_text":
        # the hybrid's layers (qwen3_5_text's), each MLP 6 experts, top 2, and a shared expert
        from transformers import Qwen3_5MoeTextConfig
        text = make_config("qwen3_5_text", common, layers).to_dict()
        keep = {k: text[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim",
                                     "linear_num_key_heads", "linear_num_value_heads",
                                     "linear_key_head_dim", "linear_value_head_dim",
                                     "linear_conv_kernel_dim", "rope_parameters",
                                     "layer_types", "max_position_embeddings",
                                     "tie_word_embeddings", "initializer_range", "rms_norm_eps",
                                     "bos_token_id", "eos_token_id")}
        cfg = Qwen3_5MoeTextConfig(**keep, num_experts=6, num_experts_per_tok=2,
                                   moe_intermediate_size=64, shared_expert_intermediate_size=32)
    elif family == "mixtral":
        # 8 experts, top 2, on every layer (whole experts on 2 or 4 devices)
        from transformers import MixtralConfig
        cfg = MixtralConfig(**{**common, "intermediate_size": 64}, head_dim=16,
                            rope_theta=10000.0, num_local_experts=8, num_experts_per_tok=2)
    elif family == "qwen3_5":
        # The multimodal checkpoint (text_config, a one-block vision tower, image and video
        # placeholder ids; tensors under model.language_model.*): the text decoder is served.
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        text = make_config("qwen3_5_text", common, layers).to_dict()
        cfg = Qwen3_5Config(text_config=text, image_token_id=250, video_token_id=251,
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                               num_heads=2, out_hidden_size=common["hidden_size"]))
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    if family == "qwen3_5":
        model = Qwen3_5ForConditionalGeneration(cfg).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 so that a missing norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(save_dtype).save_pretrained(out)
    return out


def save_gguf_as_checkpoint(gguf: Path, out: Path) -> Path:
    """What transformers reads from a GGUF file (f32 weights and the tokenizer), saved as a
    Hugging Face checkpoint folder, which loads in a second where the GGUF takes about 15 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                dtype=torch.float32)
    # transformers will not save a model it read from a GGUF: the same weights in a model built
    # from the same config (less the GGUF's quantization note) are saved instead.
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def with_rope_theta(src: Path, dst: Path, factor: float) -> Path:
    """A copy of a checkpoint whose config has a wrong rope theta (a negative control)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if "rope_parameters" in cfg:
        cfg["rope_parameters"]["rope_theta"] *= factor
    else:
        cfg["rope_theta"] *= factor
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load_reference(checkpoint: Path, *, bf16_arithmetic: bool = False, gguf_file: str | None = None):
    """The transformers model in f32. With bf16_arithmetic the linear and embedding weights are
    rounded to bf16 and every linear's input is rounded to bf16 before the product, as an
    artifact with bf16 weights computes (products and sums in f32)."""
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, **kw).eval()
    if bf16_arithmetic:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                    module.weight.copy_(module.weight.to(torch.bfloat16).to(torch.float32))
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(
                    lambda _m, args: (args[0].to(torch.bfloat16).to(torch.float32),) + args[1:])
    return model


@torch.no_grad()
def incremental_logits(model) -> Callable[[list[int]], np.ndarray]:
    """transformers' next logits after feeding ids (the prompt, then what came next), its KV
    cache kept between calls."""
    past = None

    @torch.no_grad()
    def next_logits(ids: list[int]) -> np.ndarray:
        nonlocal past
        out = model(torch.tensor([ids]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        return out.logits[0, -1].numpy()
    return next_logits


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy ids by a plain argmax loop over transformers' forward with its KV cache (no logits
    processors), and the logits of the prompt's last token."""
    out = model(torch.tensor([prompt]), use_cache=True)
    first_logits = out.logits[0, -1].float().numpy().copy()
    past, ids = out.past_key_values, []
    logits = out.logits[0, -1]
    for _ in range(steps):
        token = int(torch.argmax(logits))
        ids.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return ids, first_logits


def logits_error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute difference relative to the largest reference logit (at least 1)."""
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def quantized_reference(model, quant: str, wrong_axis: bool = False, head: bool = False,
                        group: int = 32, zero_point: bool = False):
    """The model with each decoder layer's Linear weights replaced by what a --weight-quant
    artifact computes with: the codes widened, times each output channel's scale (int4: each
    group's scale, and offset with a zero point; the head and the embedding keep theirs unless
    `head`, --quant-head: the head's weight too, per vocab row, which for a tied model is the
    embedding table; a mixture's stacked experts per expert and output channel). wrong_axis:
    the quantizer bug of the negative control (codes taken along
    the input axis, scales still per output channel; int4: each group read with its
    neighbour's scale)."""
    from triton_tlaloc.export.gguf_packed import dequantize
    from triton_tlaloc.export.quant import dequantize_rows, quantize_int4, quantize_rows

    def int4(w):
        p = quantize_int4(w, group, zero_point)
        if wrong_axis:
            p.scale = np.roll(p.scale, 1, axis=1)
        return dequantize(p)

    with torch.no_grad():
        for name, module in model.named_modules():
            stacked = getattr(module, "gate_up_proj", None)
            if isinstance(stacked, torch.nn.Parameter) and stacked.dim() == 3:
                # a mixture's experts [experts, out, in]: each expert's rows their own scales
                # (int4: each expert quantized as a linear)
                assert not wrong_axis, quant
                for p in (module.gate_up_proj, module.down_proj):
                    w = p.float().numpy()
                    if quant == "int4":
                        p.copy_(torch.from_numpy(np.stack([int4(e) for e in w])))
                        continue
                    codes, scale = quantize_rows(w, quant)
                    p.copy_(torch.from_numpy(dequantize_rows(codes, scale)))
                continue
            if isinstance(module, torch.nn.Linear) and (".layers." in f".{name}" or (
                    head and name == "lm_head")):
                w = module.weight.float().numpy()
                if quant == "int4":
                    module.weight.copy_(torch.from_numpy(int4(w)))
                    continue
                codes, scale = quantize_rows(w, quant)
                if wrong_axis:
                    codes = quantize_rows(w.T, quant)[0].T
                module.weight.copy_(torch.from_numpy(dequantize_rows(codes, scale)))
    return model


@contextlib.contextmanager
def fp8_kv_reference(model):
    """The model, while the context is open, with its keys (after RoPE) and values rounded
    through e4m3fn, clamped to +-448, as an fp8 KV pool stores them: the
    apply_rotary_pos_emb of the model's own modeling module (llama, mistral, gemma3 ...) is
    patched and each v_proj's output is rounded."""
    import sys

    def fp8(x):
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

    module = sys.modules[type(model).__module__]
    original = module.apply_rotary_pos_emb

    def rounded(q, k, *a, **kw):
        q, k = original(q, k, *a, **kw)
        return q, fp8(k)

    hooks = [m.v_proj.register_forward_hook(lambda _m, _a, out: fp8(out))
             for m in model.modules() if hasattr(m, "v_proj")]
    module.apply_rotary_pos_emb = rounded
    try:
        yield model
    finally:
        module.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(base: Path, out: Path, rank: int, seed: int, *, alpha: int | None = None,
                      rslora: bool = False, modules=LORA_MODULES, layers=None,
                      rank_pattern: dict | None = None) -> Path:
    """A PEFT LoRA adapter of `base`, saved as PEFT saves one (adapter_config.json,
    adapter_model.safetensors): random A and B (B not zero, so it changes the model; scaled
    so the change is clear but the ids stay peaked)."""
    from peft import LoraConfig, get_peft_model

    if (out / "adapter_config.json").exists():
        return out
    model = load_reference(base)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(modules),
                        use_rslora=rslora, layers_to_transform=layers, init_lora_weights=False,
                        rank_pattern=rank_pattern or {})
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(str(out))
    return out


def load_lora_reference(base: Path, adapter: Path):
    """transformers + PEFT: the base model in f32 with the adapter applied (not merged)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(base), str(adapter)).eval()

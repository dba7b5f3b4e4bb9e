"""GGUF files for tests: a copy of a GGUF file with some tensors in other quantized types,
re-encoded by gguf-py's own quantizers from the file's values (a file whose tensors mix types
as a Q4_K_M file's do, made offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np


def retyped_gguf(src: Path, dst: Path, new_type: Callable[[str], str | None]) -> Path:
    """`src` written to `dst` with each tensor for which `new_type(name)` gives a type (one
    gguf-py quantizes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) re-encoded in it; metadata and the other
    tensors as they are."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    tensors = []
    for t in reader.tensors:
        kind = new_type(t.name)
        data, qtype = t.data, t.tensor_type
        if kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            data = gguf.quants.quantize(np.asarray(values, np.float32), qtype)
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return dst


# A qwen3_moe checkpoint's tensors by GGUF name (llama.cpp's qwen3moe): per layer, HF's
# suffix, or for the experts the projection stacked over them
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate_inp": "mlp.gate", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def moe_gguf(hf_dir: Path, dst: Path, qtype: str) -> dict[str, np.ndarray]:
    """A tiny Hugging Face qwen3_moe checkpoint written as llama.cpp writes a qwen3moe GGUF: its
    metadata, each layer's experts stacked (ffn_*_exps [experts, out, in]) beside the router
    (ffn_gate_inp), the matrices of layers and experts in `qtype` (quantized by gguf-py) where
    their rows are whole blocks, the rest and the norms in F32, and a byte-level tokenizer of
    its 256 ids. Returns the values the file holds by Hugging Face name (each expert's own),
    for the oracle."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(next(hf_dir.glob("*.safetensors"))))
    writer = gguf.GGUFWriter(str(dst), "qwen3moe")
    arch = "qwen3moe"
    writer.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    writer.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    writer.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    writer.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
    writer.add_uint32(f"{arch}.attention.value_length", cfg["head_dim"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    writer.add_uint32(f"{arch}.expert_count", cfg["num_local_experts"])
    writer.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
    writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    # a byte-level BPE of the tiny model's 256 ids with no merges: what transformers needs to
    # convert a GGUF tokenizer, parsed in a moment (a real vocabulary takes seconds)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([byte_chars[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_scores([0.0] * 256)  # (no merges: single bytes merge into nothing)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    kind = gguf.GGMLQuantizationType[qtype]
    values = {}

    def add(name: str, array: np.ndarray, quantized: bool) -> np.ndarray:
        array = np.asarray(array, np.float32)
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if not quantized or array.shape[-1] % block:  # (as llama.cpp: rows of whole blocks)
            writer.add_tensor(name, array)
            return array
        data = gguf.quants.quantize(array, kind)
        writer.add_tensor(name, data, raw_dtype=kind)  # (its shape: the bytes of each row)
        return np.asarray(gguf.quants.dequantize(data, kind), np.float32).reshape(array.shape)

    values["model.embed_tokens.weight"] = add("token_embd.weight",
                                              hf["model.embed_tokens.weight"], True)
    values["model.norm.weight"] = add("output_norm.weight", hf["model.norm.weight"], False)
    values["lm_head.weight"] = add("output.weight", hf["lm_head.weight"], True)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for short, long in _LAYER.items():
            if pre + long + ".weight" in hf:
                array = hf[pre + long + ".weight"]
                values[pre + long + ".weight"] = add(f"blk.{i}.{short}.weight", array,
                                                     array.ndim == 2 and short != "ffn_gate_inp")
        experts = cfg["num_local_experts"]
        if pre + "mlp.experts.0.gate_proj.weight" not in hf:
            continue
        for short, proj in _EXPERTS.items():
            names = [f"{pre}mlp.experts.{e}.{proj}.weight" for e in range(experts)]
            stacked = add(f"blk.{i}.{short}.weight", np.stack([hf[n] for n in names]), True)
            values.update(zip(names, stacked))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values

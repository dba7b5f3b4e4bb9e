"""The Hugging Face config an artifact carries beside its manifest (`config.json` at its root),
so tools that load a model folder by its config, vLLM among them, read the artifact as one.

It describes the model as the manifest does (its shape, its tokens, the largest context an
entry holds as `max_position_embeddings`), under the architecture of its family where
transformers and vLLM know it; no tool builds a model from it here (the artifact's programs
are the model: triton_tlaloc/vllm_plugin runs them). The `tlaloc` key says whose it is.
"""

from __future__ import annotations

HF_CONFIG_NAME = "config.json"

# family -> (model_type, architecture) of the transformers model of the same layers
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                 "mistral": ("mistral", "MistralForCausalLM")}


def hf_config(manifest: dict) -> dict:
    """config.json's contents for an artifact's manifest (a family without its own entry is
    described as llama's: the key `tlaloc.family` names it)."""
    m = manifest["model"]
    model_type, architecture = ARCHITECTURES.get(m["family"], ARCHITECTURES["llama"])
    eos = m.get("eosTokenIds") or []
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": m["vocab"],
        "hidden_size": m["hiddenSize"],
        "intermediate_size": m["intermediateSize"],
        "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kvHeads"],
        "head_dim": m["headSize"],
        "max_position_embeddings": max(e["context"] for e in manifest["entries"]),
        "rms_norm_eps": m["rmsNormEps"],
        "rope_theta": m["ropeTheta"],
        "tie_word_embeddings": m["tieWordEmbeddings"],
        "bos_token_id": m.get("bosTokenId"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "torch_dtype": "float32",
        "tlaloc": {"family": m["family"], "schema": manifest["schema"],
                   "modelName": m.get("modelName")},
    }

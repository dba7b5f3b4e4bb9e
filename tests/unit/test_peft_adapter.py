"""PEFT LoRA adapters read into an artifact's adapter pools (triton_tlaloc/lora/): each module's
A and B placed in its part's fused layout (q|k|v's A rows and B's block diagonal), the scaling
folded into B (lora_alpha / r, rsLoRA's / sqrt(r), rank_pattern and alpha_pattern by module),
a module not adapted left zero; what does not fit refused by name. Adapters written here with
numpy, as PEFT saves them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from triton_tlaloc.lora.layout import LoraLayout, lora_layout
from triton_tlaloc.lora.peft_adapter import AdapterError, read_peft_adapter

# 2 layers, hidden 8, q 8 (2 heads of 4), k and v 4, MLP 12; rank up to 4, 3 slots
LAYOUT = lora_layout(4, 3, 2, 8, 8, 4, 8, 12)
PREFIX = "base_model.model.model.layers"
WIDTHS = {"self_attn.q_proj": (8, 8), "self_attn.k_proj": (8, 4), "self_attn.v_proj": (8, 4),
          "self_attn.o_proj": (8, 8), "mlp.gate_proj": (8, 12), "mlp.up_proj": (8, 12),
          "mlp.down_proj": (12, 8)}


def write_adapter(path, config: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "bias": "none", **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def module_tensors(rng, layer: int, module: str, rank: int) -> dict:
    n_in, n_out = WIDTHS[module]
    key = f"{PREFIX}.{layer}.{module}"
    return {f"{key}.lora_A.weight": rng.standard_normal((rank, n_in)).astype(np.float32),
            f"{key}.lora_B.weight": rng.standard_normal((n_out, rank)).astype(np.float32)}


def update(adapter, part: str, layer: int) -> np.ndarray:
    """The part's update matrix of a layer, [out, in], from the pools' slot arrays: module j's
    rows its B times A's rows j * rank .. (what export/lora_graph.py computes)."""
    a = adapter.arrays[f"lora.{part}.a"][layer]
    b = adapter.arrays[f"lora.{part}.b"][layer]
    p = next(p for p in LAYOUT.parts if p.part == part)
    rows, row = [], 0
    for j, n in enumerate(p.outs):
        rows.append(b[row:row + n] @ a[j * LAYOUT.max_rank:(j + 1) * LAYOUT.max_rank])
        row += n
    return np.concatenate(rows)


def test_modules_placed_in_their_parts_with_their_scaling(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {}
    for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"):
        tensors.update(module_tensors(rng, 1, module, 4 if module == "self_attn.q_proj" else 2))
    path = write_adapter(tmp_path / "ad", {"r": 2, "lora_alpha": 6, "use_rslora": True,
                                          "rank_pattern": {"q_proj": 4},
                                          "alpha_pattern": {"down_proj": 3}}, tensors)
    adapter = read_peft_adapter(path, LAYOUT)
    assert adapter.rank == 4 and len(adapter.content_hash) == 64

    def want(module, scale):
        key = f"{PREFIX}.1.{module}"
        return scale * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]

    qkv = update(adapter, "qkv", 1)  # [q 8 | k 4 | v 4, in 8]
    np.testing.assert_allclose(qkv[:8], want("self_attn.q_proj", 6 / math.sqrt(4)), rtol=1e-6)
    assert not qkv[8:12].any()  # k not adapted
    np.testing.assert_allclose(qkv[12:], want("self_attn.v_proj", 6 / math.sqrt(2)), rtol=1e-6)
    gate_up = update(adapter, "gate_up", 1)
    assert not gate_up[:12].any()
    np.testing.assert_allclose(gate_up[12:], want("mlp.up_proj", 6 / math.sqrt(2)), rtol=1e-6)
    np.testing.assert_allclose(update(adapter, "down", 1), want("mlp.down_proj",
                                                                3 / math.sqrt(2)), rtol=1e-6)
    for part in ("qkv", "o", "gate_up", "down"):  # layer 0 not adapted
        assert not update(adapter, part, 0).any()
    # the part's A rows: module j at rows j * max rank (v is module 2 of q|k|v)
    a = adapter.arrays["lora.qkv.a"][1]
    assert a[8:10].any() and not a[10:12].any()
    # plain LoRA scales by alpha / r
    o_proj = module_tensors(rng, 0, "self_attn.o_proj", 2)
    plain = read_peft_adapter(write_adapter(tmp_path / "plain", {"r": 2, "lora_alpha": 6},
                                            o_proj), LAYOUT)
    key = f"{PREFIX}.0.self_attn.o_proj"
    np.testing.assert_allclose(update(plain, "o", 0),
                               3 * o_proj[f"{key}.lora_B.weight"] @ o_proj[f"{key}.lora_A.weight"],
                               rtol=1e-6)
    assert plain.content_hash != adapter.content_hash


@pytest.mark.parametrize("config, tensors, message", [
    ({"use_dora": True}, None, "DoRA"),
    ({"bias": "all"}, None, "bias 'all'"),
    ({"modules_to_save": ["lm_head"]}, None, "modules trained whole"),
    ({"peft_type": "IA3"}, None, "only LoRA adapters"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((2, 8), np.float32)},
     "adapts what this backend does not"),
    ({"r": 6}, "rank 6", "over the artifact's largest 4"),
    ({}, "wide", "weight where the base model's is"),
    ({}, "no B", "without its pair"),
    ({"r": 3}, None, "its config says rank 3, its tensors 2"),
    # rank 0 (alpha / r would divide by zero), non-finite values, an alpha that is no number
    ({"r": 0}, "rank 0", "are not a rank-r pair"),
    ({}, "NaN B", "lora_B holds 8 values that are NaN or infinite"),
    ({}, "inf A", "lora_A holds 1 values that are NaN or infinite"),
    ({"lora_alpha": "4"}, None, "lora_alpha '4': expected a finite number"),
])
def test_what_does_not_fit_is_refused_by_name(tmp_path, config, tensors, message):
    rng = np.random.default_rng(0)
    base = module_tensors(rng, 0, "self_attn.o_proj", 2)
    if tensors == "rank 6":
        tensors = module_tensors(rng, 0, "self_attn.o_proj", 6)
    elif tensors == "wide":
        tensors = {k: np.zeros((v.shape[0], 16) if "lora_A" in k else v.shape, np.float32)
                   for k, v in base.items()}
    elif tensors == "no B":
        tensors = {k: v for k, v in base.items() if "lora_A" in k}
    elif tensors == "rank 0":
        tensors = module_tensors(rng, 0, "self_attn.o_proj", 0)
    elif tensors == "NaN B":  # (o_proj's B: 8 outputs x rank 2, the first column)
        tensors = {k: v.copy() for k, v in base.items()}
        next(v for k, v in tensors.items() if "lora_B" in k)[:, 0] = np.nan
    elif tensors == "inf A":
        tensors = {k: v.copy() for k, v in base.items()}
        next(v for k, v in tensors.items() if "lora_A" in k)[0, 0] = np.inf
    path = write_adapter(tmp_path / "ad", {"r": 2, "lora_alpha": 4, **config},
                         tensors if isinstance(tensors, dict) else base)
    with pytest.raises(AdapterError, match=message):
        read_peft_adapter(path, LAYOUT)


def test_missing_files_and_the_layout_round_trip(tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_peft_adapter(tmp_path, LAYOUT)
    assert LoraLayout.from_json(json.loads(json.dumps(LAYOUT.to_json()))) == LAYOUT
    shapes = LAYOUT.pool_shapes()
    assert shapes["lora.qkv.a"] == (2, 3, 12, 8) and shapes["lora.qkv.b"] == (2, 3, 16, 4)
    assert shapes["lora.down.a"] == (2, 3, 4, 12) and shapes["lora.down.b"] == (2, 3, 8, 4)

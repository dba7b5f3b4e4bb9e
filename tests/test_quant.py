"""Quantized weights (--weight-quant int8|fp8: codes with an f32 scale per output channel) and
fp8 KV pools (--kv-dtype fp8), against transformers computing with the same numbers: the
dequantized weights, and keys and values rounded through e4m3fn."""

from __future__ import annotations

import contextlib
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from checks.oracle import (fp8_kv_reference, load_reference, logits_error, quantized_reference,
                           reference_greedy)

from triton_tlaloc.cli import main
from triton_tlaloc.export.checkpoint import _read_safetensor, open_checkpoint
from triton_tlaloc.export.config import CheckpointError
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportError, ExportOptions, export_artifact
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import MANIFEST_NAME
from triton_tlaloc.export.quant import dequantize_rows, quantize_rows
from triton_tlaloc.runtime.core import Runtime

PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
STEPS = 16
TOL = 1e-4  # of the largest logit, f32 activations


def test_int8_codes_and_scales_follow_the_rule():
    # Scales 1 and 2 keep W / scale exact, so the halves show the rounding: half to even.
    w = np.array([[0.0, 0.0, 0.0, 0.0, 0.0],
                  [127.0, -63.5, 0.5, 1.5, 2.5],
                  [254.0, 127.0, 63.0, -1.0, -5.0]], np.float32)
    codes, scale = quantize_rows(w, "int8")
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    assert scale.tolist() == [1.0, 1.0, 2.0]  # a zero row gets 1; max |W[o, :]| / 127
    assert codes.tolist() == [[0, 0, 0, 0, 0], [127, -64, 0, 2, 2], [127, 64, 32, 0, -2]]
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 64)).astype(np.float32)
    codes, scale = quantize_rows(w, "int8")
    assert np.abs(codes).max() == 127
    assert np.abs(dequantize_rows(codes, scale) - w).max() <= scale.max() / 2 + 1e-6


def test_fp8_codes_and_scales_follow_the_rule():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 64)).astype(np.float32)
    codes, scale = quantize_rows(w, "fp8")
    assert codes.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 448, rtol=1e-6)
    widened = codes.astype(np.float32)
    assert np.abs(widened).max() == 448.0 and np.isfinite(widened).all()
    # e4m3fn keeps 3 mantissa bits: each code within half a step (1/16 relative) of W / scale
    rel = np.abs(widened - w / scale[:, None]) / np.maximum(np.abs(w / scale[:, None]), 2 ** -6)
    assert rel.max() <= 1 / 16 + 1e-6


@pytest.fixture(scope="module")
def llama(tiny):
    ckpt = tiny.checkpoint("llama", False)
    return {"ckpt": ckpt, "f32": tiny.artifact("llama", False),
            "int8": tiny.artifact("llama", False, weight_quant="int8"),
            "fp8": tiny.artifact("llama", False, weight_quant="fp8"),
            "fp8_kv": tiny.artifact("llama", False, kv_dtype="fp8")}


def first_logits_and_ids(art):
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(PROMPT)
    first = engine.prefill_chunked(seq)[0]
    engine.free(seq)
    return first, engine.generate_greedy(PROMPT, STEPS).generated_ids


# (llama's and qwen3's linears, int8 and fp8: test_tlaloc_export_quantized_weights_with_every_head)
@pytest.mark.parametrize("family,quant", [("qwen3_5_text", "int8")])
def test_quantized_weights_equal_transformers_on_the_dequantized_weights(tiny, family, quant):
    """The oracle computes with the codes times their scales; negative controls: the
    unquantized model (quantization changes the numbers) and the quantizer bug (codes taken
    along the input axis while the scales stay per output channel). qwen3_5: its Gated DeltaNet
    projections are quantized too."""
    ckpt = tiny.checkpoint(family, False)
    art = tiny.artifact(family, False, weight_quant=quant)
    err_bug = check_against_the_dequantized_model(art, ckpt, quant, f"{family} {quant}")
    assert err_bug > 100 * TOL


def check_against_the_dequantized_model(art, ckpt, quant: str, what: str, **args) -> float:
    """Greedy ids equal and logits within TOL of transformers on the dequantized weights, and
    past 10 TOL of the unquantized model; returns the error against the quantizer's bug
    (quantized_reference's wrong_axis), for the caller's bound."""
    want_ids, want = reference_greedy(quantized_reference(load_reference(ckpt), quant, **args),
                                      PROMPT, STEPS)
    _, plain = reference_greedy(load_reference(ckpt), PROMPT, 1)
    _, buggy = reference_greedy(quantized_reference(load_reference(ckpt), quant,
                                                    wrong_axis=True, **args), PROMPT, 1)
    logits, ids = first_logits_and_ids(art)
    err, err_plain, err_bug = (logits_error(logits, w) for w in (want, plain, buggy))
    print(f"{what}: logits error {err:.2e}; against the unquantized model {err_plain:.2e}; "
          f"against the quantizer's bug {err_bug:.2e}")
    assert ids == want_ids
    assert err <= TOL
    assert err_plain > 10 * TOL
    return err_bug


# `tlaloc export --weight-quant int8|fp8` of every kind of head: tied and untied, each with and
# without --quant-head, fp8 pools in two cases, the tiny qwen3 (q/k norms) in two. One batch
# and one context: two entries an artifact.
HEAD_CASES = [  # family, tied, quant, --quant-head, --kv-dtype
    ("llama", True, "int8", False, "f32"),
    ("llama", True, "int8", True, "f32"),
    ("qwen3", True, "fp8", False, "fp8"),
    ("llama", True, "fp8", True, "f32"),
    ("llama", False, "int8", False, "f32"),
    ("llama", False, "int8", True, "fp8"),
    ("qwen3", False, "fp8", False, "f32"),
    ("llama", False, "fp8", True, "f32"),
]
CLI_LADDERS = ["--batch-ladder", "1", "--context-ladder", "64", "--block-size", "8",
               "--prefill-tokens", "none", "--verify-tokens", "none", "--mixed-tokens", "none"]


def head_case_id(case) -> str:
    family, tied, quant, head, kv = case
    return (f"{family}-{'tied' if tied else 'untied'}-{quant}{'-quant-head' if head else ''}"
            f"-kv-{kv}")


@pytest.mark.parametrize("family,tied,quant,head,kv", HEAD_CASES,
                         ids=[head_case_id(c) for c in HEAD_CASES])
def test_tlaloc_export_quantized_weights_with_every_head(tiny, tmp_path, family, tied, quant,
                                                        head, kv):
    """`tlaloc export --weight-quant int8|fp8` of tied and untied heads, with and without
    --quant-head (the head quantized per vocab row; a tied table: the embedding gathers the
    same codes, times their row's scale). Without --quant-head the head keeps the weight dtype:
    a tied f32 table its [hidden, vocab] layout. Oracle: transformers with the linears (and
    with --quant-head the head's weight) dequantized, keys and values rounded through e4m3fn
    where the pools are fp8: the same greedy ids, logits within TOL. Negative controls, each
    past 10 TOL: the quantizer bug (codes taken along the input axis, the scales per output
    channel), the other head (quantized where the artifact's is not, and the reverse), and with
    fp8 pools the same weights with f32 keys and values."""
    ckpt = tiny.checkpoint(family, tied)
    art = tmp_path / "art"
    assert main(["export", str(ckpt), str(art), *CLI_LADDERS, "--weight-quant", quant,
                 "--kv-dtype", kv, *(["--quant-head"] if head else [])]) == 0
    model = load_artifact(art)
    slots = {w.slot: w for w in model.weights}
    code = "i8" if quant == "int8" else "f8E4M3FN"
    vocab, hidden = model.model.vocab, model.model.hidden_size
    assert model.model.head_quant == head
    assert {p.dtype for p in model.pools} == {"f32" if kv == "f32" else "f8E4M3FN"}
    if tied and head:
        assert slots["embed"].dtype == code and slots["embed.scale"].shape == (vocab,)
    elif tied:
        assert "embed" not in slots
        assert (slots["embed_t"].dtype, slots["embed_t"].shape) == ("f32", (hidden, vocab))
    else:
        assert slots["embed"].dtype == "f32" and "embed.scale" not in slots
        assert slots["lm_head"].dtype == (code if head else "f32")
        assert ("lm_head.scale" in slots) == head

    def reference(quant_head: bool, fp8_kv: bool, steps: int = 1, wrong_axis: bool = False):
        m = quantized_reference(load_reference(ckpt), quant, wrong_axis, head=quant_head)
        with fp8_kv_reference(m) if fp8_kv else contextlib.nullcontext():
            return reference_greedy(m, PROMPT, steps)

    fp8_kv = kv == "fp8"
    want_ids, want = reference(head, fp8_kv, STEPS)
    controls = {"the quantizer's bug": reference(head, fp8_kv, wrong_axis=True)[1],
                "the other head": reference(not head, fp8_kv)[1]}
    if fp8_kv:
        controls["f32 keys and values"] = reference(head, False)[1]
    logits, ids = first_logits_and_ids(art)
    err = logits_error(logits, want)
    errs = {what: logits_error(logits, w) for what, w in controls.items()}
    print(f"{head_case_id((family, tied, quant, head, kv))}: logits error {err:.2e}; "
          + "; ".join(f"against {what} {e:.2e}" for what, e in errs.items()))
    assert ids == want_ids
    assert err <= TOL
    assert all(e > 10 * TOL for e in errs.values()), errs


# (mistral's linears are llama's: its int4 path is tests/test_quant_kv_matrix.py's llama one)
INT4_CASES = [("llama", True, 32, True), ("qwen3", False, 32, True),
              ("gemma3_text", True, 32, False), ("qwen3_5_text", False, 32, True)]


@pytest.mark.parametrize("family,tied,group,zero_point", INT4_CASES)
def test_int4_weights_equal_transformers_on_the_dequantized_weights(tiny, family, tied, group,
                                                                   zero_point):
    """--weight-quant int4 (4-bit codes, a scale per group of 32, an offset too with a zero
    point; the head too where tied, through --quant-head), every family: transformers on the
    same dequantized weights gives the same greedy ids and logits within the tolerance. Controls:
    the unquantized model, and each group read with its neighbour's scale."""
    ckpt = tiny.checkpoint(family, tied)
    art = tiny.artifact(family, tied, weight_quant="int4", quant_group=group,
                        quant_zero_point=zero_point, quant_head=tied)
    slots = {w.slot: w for w in load_artifact(art).weights}
    packed = {s for s, w in slots.items() if w.quant is not None and "." not in s[7:]}
    assert all(w.quant == f"INT4_{'ZP_' if zero_point else ''}G{group}" for s, w in
               slots.items() if w.quant is not None) and packed
    assert ("embed" in packed) == tied  # --quant-head: the tied table is packed too
    what = f"{family} int4 g{group}{' zp' if zero_point else ''}"
    err_neighbour = check_against_the_dequantized_model(
        art, ckpt, "int4", what, group=group, zero_point=zero_point, head=tied)
    assert err_neighbour > 10 * TOL


# (the hybrid's packed linears: test_int4_weights_equal_transformers_on_the_dequantized_weights)
@pytest.mark.parametrize("family,method", [("llama", "awq"), ("qwen3", "gptq"), ("mistral", "gptq"),
                                           ("gemma3_text", "awq")])
def test_awq_and_gptq_checkpoints_are_read_as_they_are(tiny, tmp_path, family, method):
    """An AWQ (GEMM layout) or GPTQ ("gptq" format, g_idx in order) checkpoint of each
    attention family, made from the tiny model with 4-bit codes and a zero point per 32 inputs (checks/hf_quantized.py), exported
    with --weight-quant awq|gptq: its linears stay packed (B4_G32_Z0_O), and the artifact gives
    transformers' greedy ids and logits within TOL on the values they mean. Control: the
    unquantized model. The checkpoint offered as the other format is refused by name."""
    import torch
    from checks.hf_quantized import quantized_checkpoint
    from conftest import TINY_OPTS

    src = tiny.checkpoint(family, False)
    values = quantized_checkpoint(src, tmp_path / "ckpt", method, 32)
    small = dict(TINY_OPTS, batch_ladder=(1,), context_ladder=(64,))
    art = export_artifact(tmp_path / "ckpt", tmp_path / "art", ExportOptions(
        **small, weight_quant=method))
    quants = {w.slot: w.quant for w in load_artifact(art).weights}
    # every layer's down, and q|k|v where a layer attends (the layer loop's, or each layer's)
    packed = {name.split(".")[-1] for name, q in quants.items() if q == "B4_G32_Z0_O"}
    assert {"qkv", "down"} <= packed
    model = load_reference(src)
    with torch.no_grad():
        for name, module in model.named_modules():
            if f"{name}.weight" in values:
                module.weight.copy_(torch.from_numpy(values[f"{name}.weight"]))
    want_ids, want = reference_greedy(model, PROMPT, STEPS)
    _, plain = reference_greedy(load_reference(src), PROMPT, 1)
    logits, ids = first_logits_and_ids(art)
    err, err_plain = logits_error(logits, want), logits_error(logits, plain)
    print(f"{family} {method}: logits error {err:.2e}; against the unquantized model "
          f"{err_plain:.2e}")
    assert ids == want_ids
    assert err <= TOL and err_plain > 10 * TOL
    other = "gptq" if method == "awq" else "awq"
    with pytest.raises(ExportError, match=f"--weight-quant {other} keeps the blocks of an? "
                                          f"{other.upper()} checkpoint, and this checkpoint is "
                                          f"an? {method.upper()} checkpoint"):
        export_artifact(tmp_path / "ckpt", tmp_path / "other", ExportOptions(
            **small, weight_quant=other))


def test_int4_bad_options_are_refused(tiny, tmp_path):
    with pytest.raises(ExportError, match="--quant-group 64: expected one of 32, 128"):
        ExportOptions(weight_quant="int4", quant_group=64).validate()
    with pytest.raises(ExportError, match="shape --weight-quant int4"):
        ExportOptions(weight_quant="int8", quant_zero_point=True).validate()
    with pytest.raises(ExportError, match="not with --weight-dtype bf16"):
        ExportOptions(weight_quant="int4", weight_dtype="bf16").validate()
    # the tiny llama's 64 inputs are not whole groups of 128
    with pytest.raises(ExportError, match=r"weight l0.qkv: a row of 64 inputs is not whole "
                                          r"groups of 128 \(--quant-group 32"):
        export_artifact(tiny.checkpoint("llama", False), tmp_path / "a",
                        ExportOptions(weight_quant="int4", quant_group=128, layer_loop=False))
    assert not any(tmp_path.iterdir())


def test_quant_head_needs_weight_quant(tiny, tmp_path):
    with pytest.raises(Exception, match="--quant-head .* needs --weight-quant"):
        export_artifact(tiny.checkpoint("llama", True), tmp_path / "a",
                        ExportOptions(quant_head=True))


@pytest.mark.parametrize("quant,code,code_bytes", [("int8", "i8", 1), ("fp8", "f8E4M3FN", 1)])
def test_quantized_artifact_stores_codes_and_scales(llama, quant, code, code_bytes):
    art = load_artifact(llama[quant])
    plain = load_artifact(llama["f32"])
    manifest = json.loads((art.path / MANIFEST_NAME).read_text())
    assert manifest["model"]["weightQuant"] == quant
    assert art.model.model_hash != plain.model.model_hash
    by_slot = {w.slot: w for w in art.weights}  # the layers' weights stacked (the layer loop)
    assert by_slot["layers.qkv"].dtype == code and by_slot["layers.qkv.scale"].dtype == "f32"
    layers, out, n_in = by_slot["layers.qkv"].shape  # [out, in]: a scale per output channel
    assert layers == art.model.layers and n_in == art.model.hidden_size
    assert by_slot["layers.qkv.scale"].shape == (layers, out)
    # the embedding, the norms and the head keep the weight dtype
    assert {by_slot[s].dtype for s in ("embed", "lm_head", "final_norm",
                                       "layers.attn_norm")} == {"f32"}
    linears = [w for w in art.weights if w.dtype == code]
    assert len(linears) == 4  # qkv, o, gate_up, down, each stacked over the layers
    f32_bytes = sum({w.slot: w for w in plain.weights}[w.slot].byte_length for w in linears)
    assert sum(w.byte_length for w in linears) * 4 == f32_bytes * code_bytes


def test_fp8_kv_pools_equal_transformers_with_fp8_keys_and_values(llama):
    """The keys (after RoPE) and values rounded through e4m3fn in the oracle too; negative
    control: the f32 oracle, which the fp8 pools miss by far more than the tolerance."""
    model = load_reference(llama["ckpt"])
    _, plain = reference_greedy(model, PROMPT, 1)
    with fp8_kv_reference(model):
        want_ids, want = reference_greedy(model, PROMPT, STEPS)
    logits, ids = first_logits_and_ids(llama["fp8_kv"])
    err, err_plain = logits_error(logits, want), logits_error(logits, plain)
    print(f"fp8 KV: logits error {err:.2e}; against f32 KV {err_plain:.2e}")
    assert ids == want_ids
    assert err <= TOL
    assert err_plain > 10 * TOL
    rt = Runtime(llama["fp8_kv"], entries=["decode_b1_c32"])
    f32 = Runtime(llama["f32"], entries=["decode_b1_c32"])
    assert rt.kv_pool_bytes * 4 == f32.kv_pool_bytes
    # e4m3fn in the manifest, held on the device as its bytes (manifest.BITS)
    assert {p.dtype for p in rt.artifact.pools} == {"f8E4M3FN"}
    assert str(rt.pools["layers.k"].dtype) == "uint8"


def fp8_block_checkpoint(src, dst, block=16):
    """A copy of a checkpoint in the fp8 format of pre-quantized releases (quant_method "fp8",
    e4m3fn codes with weight_scale_inv per block), and the f32 weights those codes stand for."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantized = dict(tensors)
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        w = tensors[name].float()
        r, c = w.shape
        blocks = w.reshape(r // block, block, c // block, block).abs().amax(dim=(1, 3))
        scale = torch.where(blocks > 0, blocks / 448, torch.ones_like(blocks))
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        codes = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name] = codes
        tensors[name[:-len("weight")] + "weight_scale_inv"] = scale
        dequantized[name] = codes.float() * full
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block],
                                  "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


def test_an_fp8_checkpoint_is_dequantized_on_read(tiny, work):
    """A pre-quantized fp8 checkpoint reads as the f32 weights its codes and block scales stand
    for; negative control: the codes read without their scales. Other quantizations, and an AWQ
    config the reader cannot take, are refused by name."""
    from safetensors.torch import save_file

    src = tiny.checkpoint("llama", False)
    dequantized = fp8_block_checkpoint(src, work / "ckpt-llama-fp8-blocks")
    ckpt = open_checkpoint(work / "ckpt-llama-fp8-blocks")
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(ckpt.tensor(name), dequantized[name].numpy())
    codes = _read_safetensor(ckpt._where[name], name).astype(np.float32)  # negative control
    assert np.abs(codes - dequantized[name].numpy()).max() > 1.0
    assert ckpt.tensor("model.norm.weight").dtype == np.float32  # unquantized: as stored
    # the export equals the export of the dequantized weights saved as f32
    plain = work / "ckpt-llama-fp8-dequantized"
    shutil.copytree(src, plain)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, plain / "model.safetensors",
              metadata={"format": "pt"})
    opts = ExportOptions(batch_ladder=(1,), context_ladder=(32,), block_size=8, prefill_tokens=())
    a = export_artifact(work / "ckpt-llama-fp8-blocks", work / "art-llama-fp8-blocks", opts)
    b = export_artifact(plain, work / "art-llama-fp8-dequantized", opts)
    for wa, wb in zip(load_artifact(a).weights, load_artifact(b).weights):
        assert (a / wa.file).read_bytes() == (b / wb.file).read_bytes(), wa.slot
    cfg = json.loads((plain / "config.json").read_text())
    for quantization, error in (
            ({"quant_method": "bitsandbytes", "load_in_4bit": True},
             "quant_method 'bitsandbytes' is not supported"),
            ({"quant_method": "awq", "bits": 4}, r"quantization_config \(awq\): group_size None")):
        cfg["quantization_config"] = quantization
        (plain / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=error):
            open_checkpoint(plain)

"""Exported artifacts against transformers: greedy ids equal, last-token logits within a stated
tolerance, and a negative control (a wrong rope theta) that fails the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checks.oracle import load_reference, logits_error, make_tiny_checkpoint, reference_greedy, with_rope_theta

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.runtime.core import Runtime

# 20 prompt tokens + 16 generated cross from the context-32 entries to the context-128 ones.
PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
STEPS = 16
# Largest |difference| over the largest |logit| (at least 1). f32: the same arithmetic in another
# order. bf16 weights: also inputs rounded to bf16 where rounding boundaries may differ.
TOLERANCE = {"f32": 1e-4, "bf16": 1e-3}

CASES = [
    ("llama", False, "f32", 2),
    ("llama", True, "f32", 3),
    ("qwen3", True, "f32", 2),
    ("qwen3", False, "f32", 4),
    ("llama", False, "bf16", 2),
    ("qwen3", True, "bf16", 2),
]


def run_artifact(art, prompt=PROMPT, steps=STEPS):
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    first = engine.prefill_chunked(seq)[0]
    engine.free(seq)
    result = engine.generate_greedy(prompt, steps)
    return result.generated_ids, first


@pytest.mark.parametrize("family,tied,weight_dtype,layers", CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-{w}-{n}l" for f, t, w, n in CASES])
def test_greedy_ids_and_logits_match_transformers(tiny, family, tied, weight_dtype, layers):
    art = tiny.artifact(family, tied, weight_dtype, layers)
    ref = load_reference(tiny.checkpoint(family, tied, layers),
                         bf16_arithmetic=weight_dtype == "bf16")
    want_ids, want_logits = reference_greedy(ref, PROMPT, STEPS)
    got_ids, got_logits = run_artifact(art)
    err = logits_error(got_logits, want_logits)
    print(f"{family} tied={tied} {weight_dtype}: ids {got_ids}, logits error {err:.2e} "
          f"(tolerance {TOLERANCE[weight_dtype]:.0e})")
    assert got_ids == want_ids
    assert err <= TOLERANCE[weight_dtype]


@pytest.mark.parametrize("weight_dtype", ["f32", "bf16"])
def test_wrong_rope_theta_fails_the_same_check(tiny, work, weight_dtype):
    """Negative control: the same model exported with rope theta x4 must fail the tolerance."""
    good = tiny.checkpoint("llama", False)
    bad = with_rope_theta(good, work / f"ckpt-wrong-theta-{weight_dtype}", 4.0)
    art = export_artifact(bad, work / f"art-wrong-theta-{weight_dtype}",
                          ExportOptions(batch_ladder=(1,), context_ladder=(32, 128), block_size=8,
                                        weight_dtype=weight_dtype))
    ref = load_reference(good, bf16_arithmetic=weight_dtype == "bf16")
    want_ids, want_logits = reference_greedy(ref, PROMPT, STEPS)
    got_ids, got_logits = run_artifact(art)
    err = logits_error(got_logits, want_logits)
    print(f"wrong theta, {weight_dtype}: logits error {err:.2e}, "
          f"{sum(a == b for a, b in zip(got_ids, want_ids))} of {STEPS} ids equal")
    assert err > TOLERANCE[weight_dtype]
    assert got_ids != want_ids


def test_bf16_checkpoint_is_read(work):
    """A checkpoint saved in bf16 (safetensors BF16) exports to f32 with its exact values."""
    ckpt = make_tiny_checkpoint(work / "ckpt-qwen3-bf16-saved", "qwen3", tied=True, seed=3,
                                save_dtype=torch.bfloat16)
    art = export_artifact(ckpt, work / "art-qwen3-bf16-saved",
                          ExportOptions(batch_ladder=(1,), context_ladder=(32, 128), block_size=8))
    ref = load_reference(ckpt)
    want_ids, want_logits = reference_greedy(ref, PROMPT, STEPS)
    got_ids, got_logits = run_artifact(art)
    assert got_ids == want_ids
    assert logits_error(got_logits, want_logits) <= TOLERANCE["f32"]


def test_bf16_artifact_is_not_the_f32_model(tiny):
    """The bf16 tolerance tells the arithmetic apart: the f32 artifact against the bf16 oracle
    differs by more than the f32 tolerance (so the bf16 check is not vacuous)."""
    art = tiny.artifact("llama", False, "f32", 2)
    ref = load_reference(tiny.checkpoint("llama", False, 2), bf16_arithmetic=True)
    _, want_logits = reference_greedy(ref, PROMPT, 0)
    _, got_logits = run_artifact(art, steps=1)
    assert logits_error(got_logits, want_logits) > TOLERANCE["f32"]
    assert not np.array_equal(got_logits, want_logits)

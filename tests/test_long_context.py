"""Chunked prefill (--prefill-chunk) and blockwise attention (--attention-block), end to end:
each equals whole-context, one-pass prefill and transformers' greedy ids."""

from __future__ import annotations

import numpy as np
import pytest
from checks.oracle import load_reference, logits_error, reference_greedy

from triton_tlaloc.batcher import Batcher, Reply, Request
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.scheduling.policy import BatchPolicy

PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(70)]  # 70 tokens: several chunks and blocks
STEPS = 16
TOL = 1e-5  # f32, the same sums in another order

VARIANTS = {
    "whole, one pass": {},
    "chunks of 8": {"prefill_chunk": 8},
    "blockwise, key blocks of 16": {"attention_block": 16},
    "chunks of 24, key blocks of 16": {"prefill_chunk": 24, "attention_block": 16},
}


def first_logits_and_ids(art):
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(PROMPT)
    logits = engine.prefill_chunked(seq)[0]
    calls = engine.rt.donation.runs
    engine.free(seq)
    return logits, engine.generate_greedy(PROMPT, STEPS).generated_ids, calls


@pytest.fixture(scope="module")
def reference(tiny):
    return reference_greedy(load_reference(tiny.checkpoint("llama", False)), PROMPT, STEPS)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_variant_equals_whole_prefill_and_transformers(tiny, reference, variant):
    art = tiny.artifact("llama", False, **variant)
    whole_logits, whole_ids, _ = first_logits_and_ids(tiny.artifact("llama", False))
    logits, ids, calls = first_logits_and_ids(art)
    want_ids, want_logits = reference
    chunk = variant.get("prefill_chunk")
    assert calls == (-(-len(PROMPT) // chunk) if chunk else 1)
    assert logits_error(logits, whole_logits) <= TOL
    assert logits_error(logits, want_logits) <= 1e-4
    assert ids == whole_ids == want_ids


def test_manifest_records_the_chunk_and_the_key_block(tiny):
    art = load_artifact(tiny.artifact("llama", False, prefill_chunk=24, attention_block=16))
    assert {e.name: e.tokens_per_seq for e in art.entries_of("prefill")} == {
        "prefill_b1_c32": 24, "prefill_b2_c32": 24, "prefill_b1_c128": 24, "prefill_b2_c128": 24}
    assert art.manifest["model"]["prefillChunk"] == 24
    assert art.manifest["model"]["attentionBlock"] == [16]
    body = art.body_text(art.entries["prefill_b1_c128"])
    # blockwise attention is a while over key blocks, inside the layer loop's while
    decode = art.body_text(art.entries["decode_b1_c128"])
    assert art.manifest["model"]["layerLoop"] and decode.count("stablehlo.while") == 1
    assert body.count("stablehlo.while") == 2


def test_the_backend_runs_a_long_prompt_in_chunks_beside_short_ones(tiny):
    """Through the batcher: a prompt longer than tokensPerSeq runs alone in chunks while two
    short prompts share one call; each equals its solo run."""
    art = tiny.artifact("llama", False, prefill_chunk=24, attention_block=16)
    rt = Runtime(art)
    batcher = Batcher(Engine(rt), BatchPolicy(cohort_wait_s=0.0, prefill_wait_s=0.0))
    got = {}
    prompts = {"long": PROMPT, "a": PROMPT[:5], "b": PROMPT[10:20]}
    for name, prompt in prompts.items():
        batcher.submit(Request(name, prompt, True, True,
                               lambda r, n=name: got.__setitem__(n, r)))
    batcher.run_pending()
    assert batcher.stats.calls["prefill"] == 1 + 3  # a and b together; long in 3 chunks
    for name, prompt in prompts.items():
        solo = Engine(rt)
        seq = solo.new_sequence(prompt)
        want = solo.prefill_chunked(seq)[0]
        assert isinstance(got[name], Reply) and got[name].error is None
        assert np.max(np.abs(got[name].logits - want)) <= TOL * max(1.0, np.abs(want).max())

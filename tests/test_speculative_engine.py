"""Speculative decoding on compiled tiny models (no server): greedy ids with drafts verified in
verify calls equal transformers' greedy ids, for llama, qwen3 and the windowed families
(mistral, gemma3_text: rings), whatever the drafts: prompt lookup at 1-8 drafts a step, the
true continuation (every draft accepted), the true continuation gone wrong half way, random
tokens. The control: accepting one draft more than matched changes the ids."""

from __future__ import annotations

import numpy as np
import pytest
from checks.oracle import load_reference, reference_greedy

from checks.sequence_checks import TINY_PROMPT, known_drafter, random_drafter

from triton_tlaloc.engine.core import Engine, accepted_drafts
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.generation.drafting import prompt_lookup
from triton_tlaloc.pages import WINDOWED
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.kv.sequence import Sequence

STEPS = 30
# One row, one context: what a verify call needs, and little to compile. Verify and decode
# calls loop over key blocks of 8 positions, of 16 past 32 (a cut back lands in any block).
OPTS = dict(batch_ladder=(1,), context_ladder=(64,), block_size=8, verify_tokens=(5, 9),
            decode_attention_block=(8, 16))
# Window 8 in pages of 4, prefill calls of 8: rings of 4 pages, room for a call of 9 tokens.
WINDOW_OPTS = dict(OPTS, block_size=4, prefill_chunk=8, attention_block=16)
WINDOW_PROMPT = [(i * 53 + 7) % 240 + 10 for i in range(30)]
CASES = [("llama", False), ("qwen3", True), ("mistral", None), ("gemma3_text", None)]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tiny, work):
    family, tied = request.param
    if tied is None:
        ckpt, opts, prompt = tiny.window_checkpoint(family), WINDOW_OPTS, WINDOW_PROMPT
    else:
        ckpt, opts, prompt = tiny.checkpoint(family, tied), OPTS, TINY_PROMPT
    art = export_artifact(ckpt, work / f"art-spec-{family}", ExportOptions(**opts))
    want, _ = reference_greedy(load_reference(ckpt), prompt, STEPS)
    return Engine(Runtime(art)), prompt, want


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_prompt_lookup_drafts_give_transformers_greedy_ids(case, k):
    engine, prompt, want = case
    assert engine.generate_greedy(prompt, STEPS).generated_ids == want
    got = engine.generate_greedy(prompt, STEPS, speculate=k, drafter=prompt_lookup)
    assert got.generated_ids == want


def test_every_kind_of_draft_gives_the_same_ids_and_right_ones_save_calls(case):
    engine, prompt, want = case
    before = engine.executions
    engine.generate_greedy(prompt, 1)
    prompt_calls = engine.executions - before  # a windowed model's prompt runs in chunks
    for name, drafter in (("true", known_drafter(prompt, want, 8)),
                          ("half", known_drafter(prompt, want, 3)),
                          ("random", random_drafter(0))):
        before = engine.executions
        got = engine.generate_greedy(prompt, STEPS, speculate=8, drafter=drafter)
        assert got.generated_ids == want, name
        calls = engine.executions - before
        if name == "true":  # 8 drafts and the model's own token a call
            assert calls == prompt_calls + -(-(STEPS - 1) // 9), calls
        if name == "half":
            assert calls == prompt_calls + -(-(STEPS - 1) // 4), calls


def test_accepting_one_draft_more_than_matched_changes_the_ids(case):
    """The control: the acceptance rule, not the test, keeps the ids exact."""
    engine, prompt, want = case
    engine.verifier.accept = lambda d, p: min(len(d), accepted_drafts(d, p) + 1)
    try:
        got = engine.generate_greedy(prompt, STEPS, speculate=4,
                                     drafter=known_drafter(prompt, want, 2))
    finally:
        engine.verifier.accept = accepted_drafts
    assert got.generated_ids != want


def test_a_sequence_cut_back_after_wrong_tokens_goes_on_with_transformers_ids(case):
    """A draft model's sequence: each step feeds the next true token, then three wrong ones one
    call each, and is cut back to the true history (Verifier.rewind). The next token after every
    cut is transformers' (a ring cut back within its spare positions; with blocks registered
    for reuse, a cut into one computes its kept positions again in a prefill call). The
    control: the first cut one token short (a wrong token kept) changes them."""
    engine, prompt, want = case

    def run(short: int) -> list[int]:
        seq = Sequence([])
        engine.admit(seq, list(prompt))
        got = [int(np.argmax(engine.prefill_chunked(seq)[0]))]
        while len(got) < STEPS:
            engine.admit(seq, [got[-1]])
            recompute = len(seq.uncached) > 1
            logits = engine.prefill([seq]) if recompute else engine.decode([seq])
            for wrong in (3, 5, 7):
                engine.admit(seq, [wrong])
                engine.decode([seq])
            engine.verifier.rewind(seq, len(seq.token_ids) - 3 + (short if len(got) == 1 else 0))
            got.append(int(np.argmax(logits[0])))
            recomputed[0] += recompute
        engine.free(seq)
        return got
    for reuse in (False, WINDOWED not in engine.blocks.kinds):  # rings: no prefix reuse
        engine.blocks.prefix_reuse = reuse
        recomputed = [0]
        try:
            assert run(0) == want, f"prefix reuse {reuse}"
            assert (recomputed[0] > 0) == reuse
            assert run(1) != want
        finally:
            engine.blocks.prefix_reuse = False

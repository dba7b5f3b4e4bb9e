"""Prefill and decode calls on one artifact: one-call prefill equals one token at a time,
batched prompts equal their solo runs, padding never writes, pools stay in place."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from checks.engine_runs import decode_together

from triton_tlaloc.engine.core import Engine, RequestError
from triton_tlaloc.runtime.core import Runtime

PROMPT_A = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5]
PROMPT_B = [1, 64, 9, 101, 33]

# Same program family, different executables and shapes: sums may run in another order.
SAME_TOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(Runtime(tiny.artifact("llama", False)))


def sequence_kv(engine, seq, layer=0, kind="k"):
    """The K (or V) rows a sequence wrote, read back from the pool in position order."""
    pool = engine.rt.layer_kv_snapshot(layer, kind)
    bs = engine.block_size
    flat = pool.reshape(-1, *pool.shape[2:])
    slots = [seq.pages[p // bs] * bs + p % bs for p in range(seq.num_cached)]
    return flat[slots]


def test_one_call_prefill_equals_one_token_at_a_time(engine):
    whole = engine.new_sequence(PROMPT_A)
    logits_whole = engine.prefill([whole])[0]
    assert engine.rt.donation.runs >= 1
    stepped = engine.new_sequence(PROMPT_A[:1])
    logits = engine.prefill([stepped])[0]
    for token in PROMPT_A[1:]:
        stepped.token_ids.append(token)
        logits = engine.decode([stepped])[0]
    err = np.max(np.abs(logits - logits_whole))
    assert err <= SAME_TOL * max(1.0, np.max(np.abs(logits_whole))), err
    assert int(np.argmax(logits)) == int(np.argmax(logits_whole))
    for layer in (0, 1):
        np.testing.assert_allclose(sequence_kv(engine, stepped, layer, "v"),
                                   sequence_kv(engine, whole, layer, "v"), atol=1e-5)
    engine.free(whole)
    engine.free(stepped)


def test_two_prompts_in_one_batch2_call_equal_their_solo_runs(engine):
    solo = {}
    for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        seq = engine.new_sequence(prompt)
        solo[name] = engine.prefill([seq])[0]
        engine.free(seq)
    a, b = engine.new_sequence(PROMPT_A), engine.new_sequence(PROMPT_B)
    before = engine.rt.donation.runs
    both = engine.prefill([a, b])
    assert engine.rt.donation.runs == before + 1, "the two prompts ran as one call"
    for got, want in ((both[0], solo["a"]), (both[1], solo["b"])):
        assert np.max(np.abs(got - want)) <= SAME_TOL * max(1.0, np.max(np.abs(want)))
    # and they keep decoding together as their solo runs do
    ids_batched, _ = decode_together(engine, [a, b], both, 6)
    engine.free(a)
    engine.free(b)
    for prompt, ids in ((PROMPT_A, ids_batched[0]), (PROMPT_B, ids_batched[1])):
        assert engine.generate_greedy(prompt, 6).generated_ids == ids


def test_padding_never_writes_the_pool(engine):
    """A batch-2 prefill entry given one 5-token row: 27 padding tokens in the row and one
    padding row. Every pool byte outside the sequence's 5 slots stays as it was."""
    layers = [(layer, kind) for layer in (0, 1) for kind in "kv"]
    before = {lk: engine.rt.layer_kv_snapshot(*lk) for lk in layers}
    seq = engine.new_sequence(PROMPT_B)
    entry = engine.entry_for("prefill", 2, len(PROMPT_B), len(PROMPT_B))
    assert entry.batch == 2 and entry.tokens_per_seq > len(PROMPT_B)
    engine._call(entry, [seq], [seq.uncached])
    bs = engine.block_size
    written = [seq.pages[p // bs] * bs + p % bs for p in range(len(PROMPT_B))]
    for name, old in before.items():
        new = engine.rt.layer_kv_snapshot(*name)
        flat_old, flat_new = old.reshape(-1, *old.shape[2:]), new.reshape(-1, *new.shape[2:])
        outside = np.ones(flat_old.shape[0], bool)
        outside[written] = False
        assert np.array_equal(flat_old[outside], flat_new[outside]), name
        assert not np.array_equal(flat_old[written], flat_new[written]), name
        # slot -1 would land on the pool's last slot if it were wrapped
        assert np.array_equal(flat_new[-1], flat_old[-1])
    engine.free(seq)


def test_jax_wraps_negative_scatter_indices():
    """Why padding slots are remapped before the scatter: JAX wraps -1 to the last index, even
    with mode='drop'. The decoder sends negative slots past the end instead."""
    wrapped = jnp.zeros(4).at[jnp.array([-1])].set(1.0, mode="drop")
    assert float(wrapped[3]) == 1.0
    remapped = jnp.zeros(4).at[jnp.array([4])].set(1.0, mode="drop")
    assert float(jnp.sum(remapped)) == 0.0


def test_requests_past_the_context_or_vocabulary_are_refused_by_name(engine):
    free_before = engine.blocks.full.free
    with pytest.raises(RequestError, match="exceed the largest context 128"):
        engine.generate_greedy(list(range(3, 3 + 129)), 1)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.new_sequence([1, 256])
    assert engine.blocks.full.free == free_before, "a refused request holds no pages"


def test_pools_in_place_100_of_100_and_copied_without_the_aliases(tiny):
    """100 decode steps with the pools donated: 100 of 100 in place. The same artifact with the
    alias attributes stripped: 100 of 100 copied, identical ids."""
    art = tiny.artifact("llama", False)
    results = {}
    for donate in (True, False):
        rt = Runtime(art, donate=donate, entries=["prefill_b1_c128", "decode_b1_c128"],
                     check_every_run=True)
        res = Engine(rt).generate_greedy([1, 5, 9], 101)  # 1 prefill + 100 decode steps
        assert len(res.decode_ms_per_token) == 100
        results[donate] = (res.generated_ids, rt.donation)
    ids_in_place, stats = results[True]
    assert (stats.runs, stats.checked_runs, stats.in_place, stats.copied) == (101, 101, 101, 0)
    ids_copied, stats = results[False]
    assert (stats.runs, stats.checked_runs, stats.in_place, stats.copied) == (101, 101, 0, 101)
    assert ids_copied == ids_in_place


def test_a_short_prompt_runs_in_a_small_prefill_entry_with_the_same_logits(tiny):
    """The prefill token ladder: a 40-token prompt at the 128 context runs in the 64-token
    entry, and its logits equal those of the 128-token entry (padding changes nothing)."""
    art = tiny.artifact("llama", False)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(40)]
    small = Engine(Runtime(art, entries=["prefill_b1_c128_t64"]))
    whole = Engine(Runtime(art, entries=["prefill_b1_c128"]))
    assert small.rt.artifact.entries["prefill_b1_c128_t64"].tokens_per_seq == 64
    got = small.prefill([small.new_sequence(prompt)])[0]
    want = whole.prefill([whole.new_sequence(prompt)])[0]
    assert small.rt.donation.entries_checked == {"prefill_b1_c128_t64"}
    tol = SAME_TOL * max(1.0, float(np.max(np.abs(want))))
    assert float(np.max(np.abs(got - want))) <= tol
    # Negative control: a padding bug that lost the prompt's first token fails the check.
    lost = whole.prefill([whole.new_sequence(prompt[1:])])[0]
    assert float(np.max(np.abs(lost - want))) > tol

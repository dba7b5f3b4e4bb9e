"""Speculation in the batcher: verify calls over the fake runtime, whose model is a rule (the next
token after token t at position p is (t + p) % vocab), so a drafter can be right, wrong or half
right on purpose. Greedy ids with drafts must equal greedy ids without, whatever the drafts."""

import numpy as np
import pytest

from checks.fakes import Harness, fake_artifact

from triton_tlaloc.engine.core import accepted_drafts
from triton_tlaloc.pages import FULL, pages_for

VOCAB = 256


def rule_drafts(history: list[int], k: int) -> list[int]:
    """The k tokens the fake model will choose next: every draft right."""
    out, last, pos = [], history[-1], len(history) - 1
    for _ in range(k):
        last, pos = (last + pos) % VOCAB, pos + 1
        out.append(last)
    return out


def random_drafts(rng):
    return lambda history, k: rng.integers(0, VOCAB, k).tolist()


def half_right(history, k):
    """Right for the first half, then off by one."""
    good = rule_drafts(history, k)
    return good[:k // 2] + [(t + 1) % VOCAB for t in good[k // 2:]]


def greedy(h, seq_id, prompt, n_new, drafter=None, k=0):
    """Greedy ids through the batcher; with a drafter each request after the prompt carries
    the next token and k drafts. Checks after every reply that the sequence holds exactly the
    pages its length needs and that its KV holds its tokens."""
    reply = h.step(seq_id, prompt, start=True)
    ids = [int(np.argmax(reply.logits))]
    while len(ids) < n_new:
        if drafter is not None:
            drafts = drafter(prompt + ids, k)
            reply = h.step(seq_id, [ids[-1]] + drafts, draft_tokens=len(drafts))
            assert reply.error is None, reply.error
            assert 1 <= len(reply.accepted_ids) <= k + 1
            assert reply.accepted_ids[:-1] == drafts[:len(reply.accepted_ids) - 1]
            ids += reply.accepted_ids
            assert int(np.argmax(reply.logits)) == ids[-1]
        else:
            reply = h.step(seq_id, [ids[-1]])
            ids.append(int(np.argmax(reply.logits)))
        seq = h.batcher.sequences[seq_id]
        assert seq.token_ids == prompt + ids[:-1]
        assert seq.num_cached == len(seq.token_ids)
        blocks, engine = pages_for(len(seq.token_ids), 8), h.batcher.engine
        if engine.blocks.kinds[FULL].holds:
            assert len(seq.pages) == blocks
            assert h.rt.kv_of(seq) == seq.token_ids
        assert len(seq.ring) == min(blocks, engine.ring_pages)
    return ids[:n_new]


def test_accepted_drafts_counts_the_leading_agreement():
    assert accepted_drafts([5, 6, 7], [5, 6, 7]) == 3
    assert accepted_drafts([5, 6, 7], [5, 9, 7]) == 1  # nothing after the first miss
    assert accepted_drafts([5, 6, 7], np.array([4, 6, 7])) == 0
    assert accepted_drafts([], []) == 0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_ids_with_drafts_equal_greedy_ids_without(k):
    prompt = [3, 14, 15, 92, 65]
    want = greedy(Harness(fake_artifact()), 1, prompt, 40)
    rng = np.random.default_rng(k)
    for drafter in (rule_drafts, random_drafts(rng), half_right):
        h = Harness(fake_artifact())
        assert greedy(h, 1, prompt, 40, drafter, k) == want, drafter
        h.batcher.engine.blocks.check(list(h.batcher.sequences.values()))


def test_right_drafts_save_calls_and_wrong_ones_cost_none():
    prompt = [1, 2, 3]
    h = Harness(fake_artifact())
    greedy(h, 1, prompt, 41, rule_drafts, 8)
    assert h.batcher.stats.calls["verify"] == 5  # 1 + 5 x 8 ids after the prompt's
    assert h.batcher.stats.accepted == h.batcher.stats.drafted == 40
    h = Harness(fake_artifact())
    greedy(h, 1, prompt, 41, random_drafts(np.random.default_rng(0)), 4)
    assert h.batcher.stats.calls["verify"] >= 38 and h.batcher.stats.accepted <= 2


def test_accepting_one_draft_more_than_matched_changes_the_ids():
    """The negative control: the acceptance rule is what keeps the ids exact."""
    prompt = [3, 14, 15, 92, 65]
    want = greedy(Harness(fake_artifact()), 1, prompt, 30)
    h = Harness(fake_artifact())
    h.batcher.engine.verifier.accept = lambda d, p: min(len(d), accepted_drafts(d, p) + 1)
    reply = h.step(1, prompt, start=True)
    ids = [int(np.argmax(reply.logits))]
    while len(ids) < 30:
        drafts = half_right(prompt + ids, 4)
        ids += h.step(1, [ids[-1]] + drafts, draft_tokens=4).accepted_ids
    assert ids[:30] != want


def test_a_rejected_draft_releases_the_page_it_took():
    h = Harness(fake_artifact())
    prompt = list(range(1, 8))  # 7 tokens: the next one fills the first page
    first = int(np.argmax(h.step(1, prompt, start=True).logits))
    free_before = h.batcher.pool_state()["full"][2]
    wrong = [(t + 1) % VOCAB for t in rule_drafts(prompt + [first], 4)]
    reply = h.step(1, [first] + wrong, draft_tokens=4)  # positions 7-11: a second page
    assert reply.accepted_ids == rule_drafts(prompt + [first], 1)
    seq = h.batcher.sequences[1]
    assert len(seq.token_ids) == 8 and len(seq.pages) == 1
    assert h.batcher.pool_state()["full"][2] == free_before
    assert reply.kv_pages == (1, 0)


def test_a_verify_call_runs_beside_decode_rows_and_batches_its_sequences():
    prompt_a, prompt_b, prompt_c = [5, 6, 7], [9, 10], [11, 12, 13, 14]
    want = {s: greedy(Harness(fake_artifact()), s, p, 20)
            for s, p in ((1, prompt_a), (2, prompt_b), (3, prompt_c))}
    h = Harness(fake_artifact())
    ids = {}
    for s, p in ((1, prompt_a), (2, prompt_b), (3, prompt_c)):
        h.send(s, p, start=True)
    h.clock.advance(1.0)
    h.run()
    prompts = {1: prompt_a, 2: prompt_b, 3: prompt_c}
    for s in prompts:
        ids[s] = [int(np.argmax(h.last(s).logits))]
    rng = np.random.default_rng(1)
    together = 0
    while min(len(v) for v in ids.values()) < 20:
        for s in (1, 2):  # drafting, one right and one random
            drafter = rule_drafts if s == 1 else random_drafts(rng)
            h.send(s, [ids[s][-1]] + drafter(prompts[s] + ids[s], 3), draft_tokens=3)
        h.send(3, [ids[3][-1]])
        h.clock.advance(1.0)
        calls = h.run()
        # one decode call, and the two verify rows in one call while they share a bucket
        assert [rows for e, rows in calls if e.startswith("decode")] == [1]
        verify_rows = [rows for e, rows in calls if e.startswith("verify")]
        assert sum(verify_rows) == 2
        together += verify_rows == [2]
        for s in (1, 2):
            ids[s] += h.last(s).accepted_ids
        ids[3].append(int(np.argmax(h.last(3).logits)))
    assert together >= 3
    for s in prompts:
        assert ids[s][:20] == want[s][:20]


def test_cut_back_blocks_are_registered_with_the_accepted_tokens_only():
    """A prompt sharing the speculating sequence's history reuses its blocks: their hashes and
    KV are the accepted tokens', not the rejected drafts'."""
    h = Harness(fake_artifact())
    prompt = [7] * 5
    ids = greedy(h, 1, prompt, 30, half_right, 6)
    h.step(1, [], end=True)
    history = prompt + ids[:-1]
    reply = h.step(2, history + [ids[-1]], start=True)
    seq = h.batcher.sequences[2]
    assert seq.reused >= 24 and h.rt.kv_of(seq) == seq.token_ids
    assert int(np.argmax(reply.logits)) == greedy(Harness(fake_artifact()), 3, history
                                                  + [ids[-1]], 1)[0]


def refused(h, seq_id, tokens, drafts, reason):
    before = h.batcher.sequences[seq_id]
    state = (list(before.token_ids), list(before.pages), list(before.ring))
    reply = h.step(seq_id, tokens, draft_tokens=drafts)
    assert reply.code == "INVALID_ARG" and reply.accepted_ids is None, reply
    assert h.batcher.stats.refusals.get("speculation", 0) >= 1
    after = h.batcher.sequences[seq_id]
    assert after is before and (after.token_ids, after.pages, after.ring) == state
    return reply.error


def test_what_cannot_be_verified_is_refused_by_name_and_changes_nothing():
    h = Harness(fake_artifact())
    first = int(np.argmax(h.step(1, [1, 2, 3], start=True).logits))
    assert "first request" in h.step(2, [1, 2, 3], start=True, draft_tokens=1).error
    assert 2 not in h.batcher.sequences
    assert "expected 1 to 2" in refused(h, 1, [first, 5, 6], 3, "speculation")
    assert "at most 9" in refused(h, 1, [first] + [4] * 9, 9, "speculation")
    # the sequence goes on as if nothing had been asked
    assert h.step(1, [first] + rule_drafts([1, 2, 3, first], 2), draft_tokens=2).error is None
    h = Harness(fake_artifact(verify_tokens=()))
    first = int(np.argmax(h.step(1, [1, 2, 3], start=True).logits))
    assert "no verify entries" in refused(h, 1, [first, 4], 1, "speculation")


def test_a_linear_attention_state_and_a_full_ring_refuse_drafts():
    h = Harness(fake_artifact(state_slots=2))
    first = int(np.argmax(h.step(1, [1, 2, 3], start=True).logits))
    assert "cannot be cut back" in refused(h, 1, [first, 4], 1, "speculation")
    # a ring of 2 pages of 8 over a window of 12: 16 - 11 = 5 positions for a call's tokens
    ringed = dict(window=12, ring_pages=2, window_blocks=9)
    h = Harness(fake_artifact(**ringed))
    prompt = list(range(1, 21))
    first = int(np.argmax(h.step(1, prompt, start=True).logits))
    assert "ring" in refused(h, 1, [first] + [4] * 5, 5, "speculation")
    ids = greedy(Harness(fake_artifact(**ringed)), 2, prompt, 20)
    h = Harness(fake_artifact(**ringed))
    reply = h.step(2, prompt, start=True)
    got = [int(np.argmax(reply.logits))]
    while len(got) < 20:
        drafts = half_right(prompt + got, 4)
        got += h.step(2, [got[-1]] + drafts, draft_tokens=4).accepted_ids
        assert len(h.batcher.sequences[2].ring) == 2
    assert got[:20] == ids


def test_prompt_lookup_follows_the_latest_longest_match():
    from triton_tlaloc.generation.drafting import prompt_lookup

    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert prompt_lookup(text, 3) == [4, 5, 9]  # "1 2 3" occurred at the start
    assert prompt_lookup(text, 3, max_ngram=2) == [7, 8, 1]  # "2 3" last followed by 7 8 1
    assert prompt_lookup(text, 2, max_ngram=1) == [7, 8]  # "3" last followed by 7
    assert prompt_lookup(text, 10)[:3] == [4, 5, 9] and len(prompt_lookup(text, 10)) == 10
    assert prompt_lookup([5, 6, 7], 4) == []  # nothing repeats
    assert prompt_lookup([5, 6, 7, 5], 0) == [] and prompt_lookup([5], 2) == []
    assert prompt_lookup([4, 4, 4, 4], 3) == [4]  # only what follows the latest match
    assert prompt_lookup(text, 3, min_ngram=4) == []


@pytest.mark.parametrize("drafter", [rule_drafts, half_right, None])
def test_the_engine_alone_generates_the_same_ids_with_drafts(drafter):
    """`tlaloc run --speculate`: the engine's own greedy loop, up to the largest context."""
    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.generation.drafting import prompt_lookup

    from checks.fakes import FakeRuntime

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = Engine(FakeRuntime(fake_artifact())).generate_greedy(prompt, 200)
    assert want.finish_reason == "context" and len(want.generated_ids) == 121
    rt = FakeRuntime(fake_artifact())
    got = Engine(rt).generate_greedy(prompt, 200, speculate=8,
                                     drafter=drafter or prompt_lookup)
    assert got.generated_ids == want.generated_ids and got.finish_reason == "context"
    if drafter is rule_drafts:  # 8 drafts a call while they fit, then fewer
        assert sum(e.startswith("verify") for e, _ in rt.calls) < 20
    stopped = Engine(FakeRuntime(fake_artifact())).generate_greedy(
        prompt, 200, stop_ids=(want.generated_ids[30],), speculate=8, drafter=rule_drafts)
    assert stopped.generated_ids == want.generated_ids[:31]
    assert stopped.finish_reason == "stop"

"""Admission, refusal, rollback, rings and state slots through the engine and the batcher over a
fake runtime: every refusal names the problem and leaves the sequence and the pools as they
were; every request is answered exactly once."""

from __future__ import annotations

import threading

import pytest
from checks.fakes import FakeRuntime, Harness, fake_artifact

from triton_tlaloc.batcher import INTERNAL, INVALID_ARG, UNAVAILABLE, Batcher, Request
from triton_tlaloc.engine.core import Engine, RequestError, Sequence
from triton_tlaloc.pages import PagesExhausted
from triton_tlaloc.scheduling.policy import BatchPolicy


def snapshot(engine: Engine, seq: Sequence) -> tuple:
    return (list(seq.token_ids), seq.num_cached, list(seq.pages), list(seq.ring),
            seq.state_slot, {k: p.free for k, p in engine.pools().items()})


@pytest.mark.parametrize("tokens, message", [
    ([5, 256], "token id 256 is outside the vocabulary \\[0, 256\\)"),
    ([5, 7], "token id 7 is the checkpoint's image_token_id placeholder"),
    (list(range(8, 137)), "133 positions would exceed the largest context 128"),
])
def test_a_refused_admission_changes_nothing(tokens, message):
    engine = Engine(FakeRuntime(fake_artifact(refused_tokens=(
        {"id": 7, "configKey": "image_token_id"},))))
    seq = Sequence([])
    engine.admit(seq, [1, 2, 3, 4])
    before = snapshot(engine, seq)
    with pytest.raises(RequestError, match=message):
        engine.admit(seq, tokens)
    assert snapshot(engine, seq) == before


def test_a_full_pool_refuses_without_taking_a_page_then_admits_after_a_release():
    engine = Engine(FakeRuntime(fake_artifact()))  # 32 usable pages of 8 tokens
    holders = [Sequence([]) for _ in range(2)]
    for i, s in enumerate(holders):
        engine.admit(s, list(range(1 + i, 121 + i)))  # 15 pages each (prompts share nothing)
    seq = Sequence([])
    with pytest.raises(PagesExhausted, match="3 pages needed, 2 free of 32"):
        engine.admit(seq, list(range(1, 21)))
    assert engine.blocks.full.free == 2 and seq.pages == [] and seq.token_ids == []
    engine.free(holders[0])
    engine.admit(seq, list(range(1, 21)))
    assert len(seq.pages) == 3 and engine.blocks.full.free == 14


def test_a_failed_call_answers_once_with_internal_and_rolls_the_sequence_back():
    h = Harness(fake_artifact())
    assert h.step("a", [1, 2, 3], start=True).error is None
    seq = h.batcher.sequences["a"]
    before = snapshot(h.batcher.engine, seq)
    h.rt.fail_next = RuntimeError("device lost")
    reply = h.step("a", [4])
    assert reply.code == INTERNAL and "decode call failed: RuntimeError: device lost" in reply.error
    assert len(h.replies["a"]) == 2
    assert snapshot(h.batcher.engine, seq) == before, "rolled back to before the request"
    assert h.step("a", [4]).logits is not None, "the same request then succeeds"
    # a failed START leaves no sequence behind
    h.rt.fail_next = RuntimeError("device lost")
    assert h.step("b", [1, 2], start=True).code == INTERNAL
    assert "b" not in h.batcher.sequences


def test_a_hybrid_models_state_slots_are_held_for_life_refused_by_name_and_reused():
    h = Harness(fake_artifact(state_slots=1))
    assert h.step("a", [1, 2, 3], start=True).error is None
    assert h.batcher.sequences["a"].state_slot == 0
    reply = h.step("b", [1, 2], start=True)
    assert reply.code == UNAVAILABLE and "no free linear-attention state slot" in reply.error
    assert "b" not in h.batcher.sequences and h.batcher.sequences["a"].state_slot == 0
    assert h.step("a", [4]).logits is not None, "the holder goes on"
    assert h.step("a", [], end=True).error is None
    assert h.step("b", [1, 2], start=True).error is None
    assert h.batcher.sequences["b"].state_slot == 0


@pytest.mark.parametrize("slots", [None, 1])
def test_a_refusal_for_want_of_pages_or_slots_names_no_other_sequence(slots, caplog):
    """A correlation id is the only capability a sequence has: a refusal tells the client how
    many sequences hold pages (or slots), and only the server log says which."""
    h = Harness(fake_artifact(state_slots=slots))
    holders = (9_111_222_333, 9_444_555_666)
    for i, sid in enumerate(holders[:1 if slots else 2]):
        assert h.step(sid, list(range(1 + i, 121 + i)), start=True).error is None
    with caplog.at_level("INFO", logger="triton_tlaloc.batcher"):
        reply = h.step(7, list(range(5, 125)) if not slots else [1, 2], start=True)
    assert reply.code == UNAVAILABLE
    assert ("1 sequences hold slots" if slots else "2 sequences hold pages") in reply.error
    for sid in holders:
        assert str(sid) not in reply.error
    assert str(holders[0]) in caplog.text, "the server log names the holders"


def test_a_request_refused_before_admission_still_follows_the_start_and_activity_rules():
    """TOKENS too long to convert is refused by the front end's size check, but through the
    batcher: a START on a held id still releases the old sequence (its KV must never be
    continued), and a step still counts as the sequence's activity (no reclamation)."""
    h = Harness(fake_artifact())
    assert h.step("a", [1, 2, 3], start=True).error is None
    h.clock.advance(50.0)
    reply = h.step("a", [], refusal=("context", "sequence a: TOKENS holds 10^6 ids"))
    assert reply.code == INVALID_ARG and "10^6" in reply.error
    assert h.batcher.sequences["a"].last_active == h.clock(), "counted as activity"
    assert h.step("a", [4]).logits is not None, "a step refused so leaves the sequence as it was"
    reply = h.step("a", [], start=True, refusal=("context", "sequence a: TOKENS holds 10^6"))
    assert reply.code == INVALID_ARG and "a" not in h.batcher.sequences
    assert h.batcher.pool_state()["full"][0] == 0, "no live sequence holds its pages"
    assert h.step("a", [5]).code == INVALID_ARG, "the old KV cannot be continued"


def test_a_windowed_sequence_holds_at_most_its_ring():
    # every layer sliding (window 8, pages of 8): rings of 2 pages, no full-history pages
    h = Harness(fake_artifact(window=8, ring_pages=2, window_blocks=9))
    h.step("a", list(range(1, 9)), start=True)
    for t in range(40):
        assert h.step("a", [t + 1]).logits is not None
    seq = h.batcher.sequences["a"]
    assert len(seq.token_ids) == 48 and seq.pages == [] and len(seq.ring) == 2


def test_unknown_sequence_and_empty_tokens_are_refused_by_name():
    h = Harness(fake_artifact())
    reply = h.step("x", [5])
    assert reply.code == INVALID_ARG and "is not held by the model" in reply.error
    h.step("y", [1], start=True)
    reply = h.step("y", [])
    assert reply.code == INVALID_ARG and "TOKENS is empty" in reply.error


def test_the_thread_answers_every_request_and_stop_answers_the_rest():
    batcher = Batcher(Engine(FakeRuntime(fake_artifact())), BatchPolicy(prefill_wait_s=0.0))
    replies, done = [], threading.Event()

    def reply_fn(reply):
        replies.append(reply)
        if len(replies) == 8:
            done.set()
    batcher.start()
    for i in range(8):
        batcher.submit(Request(f"s{i}", [1, 2, 3], True, False, reply_fn))
    assert done.wait(10), f"{len(replies)} of 8 answered"
    assert all(r.logits is not None for r in replies)
    batcher.stop()
    late = []
    batcher.submit(Request("late", [1], True, False, late.append))
    assert late[0].code == UNAVAILABLE and "unloading" in late[0].error


def test_a_step_refused_for_pages_leaves_the_held_sequence_whole():
    """A held sequence's step refused for want of pages keeps everything it held (a refusal
    changes nothing), and a START refused so gives back the cached blocks it attached."""
    h = Harness(fake_artifact())  # 32 usable pages of 8 tokens
    for i, sid in enumerate("pqrs"):
        assert h.step(sid, list(range(10 + i, 74 + i)), start=True).error is None  # 8 pages
    before = snapshot(h.batcher.engine, h.batcher.sequences["p"])
    assert h.step("p", [5]).code == UNAVAILABLE
    assert snapshot(h.batcher.engine, h.batcher.sequences["p"]) == before
    # a START whose prefix is cached (q's first 7 blocks) but whose last block finds no page
    assert h.step("t", list(range(11, 75)) + [1], start=True).code == UNAVAILABLE
    assert h.batcher.engine.blocks.full.refs[h.batcher.sequences["q"].pages[0]] == 1
    h.batcher.engine.blocks.check(list(h.batcher.sequences.values()))


def test_the_batchers_counters_follow_reuse_and_evictions():
    """BatcherStats counts what STARTs found cached, continued turns, evicted cached pages and
    dropped kept sequences (the same reports feed the Prometheus metrics)."""
    h = Harness(fake_artifact(num_blocks=9))  # 8 pages of 8 tokens
    prompt = list(range(10, 34))  # 3 blocks
    assert h.step("a", prompt, start=True).error is None
    assert h.step("a", [], end=True).error is None
    assert h.step("b", prompt + [1], start=True).error is None  # continues a: 24 reused
    assert h.step("b", [], end=True).error is None
    stats = h.batcher.stats
    assert (stats.prefix_queried, stats.prefix_reused, stats.continuations) == (49, 24, 1)
    # c takes all 8 pages: the 4 never used, then b (kept: 4 pages) is dropped, its last
    # page is free and its 3 cached blocks are evicted
    assert h.step("c", list(range(100, 164)), start=True).error is None
    assert (stats.evicted_pages, stats.dropped_sequences) == (3, 1)
    h.batcher.engine.blocks.check(list(h.batcher.sequences.values()))

"""A sequence's status (sequence.SequenceStatus) through the batcher: every change of where a
sequence is goes through `Sequence.move_to`, which refuses one the table does not allow, and
`BlockManager.check` holds each status to what the sequence holds. Controls: an illegal
transition is refused, and a status that says the wrong thing is caught by the check."""

from __future__ import annotations

import pytest
from checks.fakes import Harness, fake_artifact

from triton_tlaloc.kv.sequence import NEXT, Sequence, SequenceStatus as S

BIG = 1 << 30


def status(h: Harness, seq_id) -> S:
    return h.batcher.sequences[seq_id].status


def test_a_sequence_walks_every_status_through_the_batcher():
    h = Harness(fake_artifact(num_blocks=9), host_bytes=BIG)  # 8 pages
    h.step("a", range(10, 42), start=True)  # 4 pages
    a = h.batcher.sequences["a"]
    assert a.status is S.RUNNING
    h.step("b", range(50, 82), start=True)  # the pool is full
    h.step("c", range(100, 116), start=True)  # a, idle longest, swapped out for c
    assert a.status is S.SWAPPED and status(h, "b") is S.RUNNING
    h.step("a", [7])  # swapped back in (b goes out)
    assert a.status is S.RUNNING and status(h, "b") is S.SWAPPED
    h.batcher.engine.drop(a)  # preempted: its KV given up
    assert a.status is S.PREEMPTED
    h.batcher.engine.blocks.check([s for s in h.batcher.sequences.values()
                                   if s.swapped is None])
    h.step("a", [8])  # computed again
    assert a.status is S.RUNNING
    h.step("a", [], end=True)  # ended: kept whole for its next turn
    assert a.status is S.KEPT and "a" not in h.batcher.sequences
    h.step("d", a.token_ids + [9, 10], start=True)  # the next turn takes it over
    assert a.status is S.FINISHED and status(h, "d") is S.RUNNING
    for k in "bcd":
        h.step(k, [], end=True)
    assert h.batcher.stats.swaps["out"] >= 2 and not h.batcher.sequences


def test_a_call_held_for_a_compile_is_held_then_running():
    art = fake_artifact()
    h = Harness(art, compiling=[n for n in art.entries if n.startswith("prefill")])
    h.send("a", range(10, 30), start=True)
    h.clock.advance(1.0)
    h.run()
    assert status(h, "a") is S.HELD_FOR_COMPILE
    h.compile(h.rt.wanted[0])
    h.run()
    assert status(h, "a") is S.RUNNING and h.last("a").error is None


def test_an_illegal_transition_is_refused_and_a_wrong_status_is_caught():
    seq = Sequence([1, 2])
    assert seq.status is S.WAITING
    with pytest.raises(AssertionError, match="waiting cannot become swapped"):
        seq.move_to(S.SWAPPED)
    assert not NEXT[S.FINISHED]  # nothing comes after finished
    kept = Sequence([1])
    kept.move_to(S.RUNNING)
    kept.move_to(S.KEPT)
    with pytest.raises(AssertionError, match="kept cannot become running"):
        kept.move_to(S.RUNNING)
    # The check holds a status to what the sequence holds: a running sequence told it is
    # swapped out, with no host copy, is caught.
    h = Harness(fake_artifact())
    h.step("a", range(10, 20), start=True)
    live = list(h.batcher.sequences.values())
    h.batcher.engine.blocks.check(live)
    live[0].status = S.SWAPPED  # the control, set past move_to
    with pytest.raises(AssertionError, match="swapped with a host copy: None"):
        h.batcher.engine.blocks.check(live)

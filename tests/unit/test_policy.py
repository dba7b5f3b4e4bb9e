"""When the batcher runs what, and what it reclaims: a fake clock and a fake runtime over an
artifact described in code (checks/fakes.py), deterministic and fast."""

from __future__ import annotations

import pytest
from checks.fakes import Harness, fake_artifact

from triton_tlaloc.batcher import INVALID_ARG, UNAVAILABLE, Request
from triton_tlaloc.scheduling.policy import choose_reclaim
from triton_tlaloc.scheduling.policy import BatchPolicy, Cohort, select

MS = 1e-3


@pytest.fixture(scope="module")
def artifact():
    # batches 1 and 2, contexts 32 and 128, 8-token pages, 32 usable pages
    return fake_artifact()


def test_a_lone_sequence_never_waits(artifact):
    h = Harness(artifact)
    h.send("a", [1, 2, 3], start=True)
    assert h.run() == [], "a prompt waits prefill_wait for prompts sent with it"
    h.clock.advance(2 * MS)
    assert h.run() == [("prefill_b1_c32", 1)]
    for t in range(5):
        h.send("a", [t + 4])
        assert h.run() == [("decode_b1_c32", 1)], "its own cohort is complete at once"
    assert max(h.batcher.stats.waits_s) <= 2 * MS
    assert list(h.batcher.stats.waits_s)[1:] == [0.0] * 5


@pytest.mark.parametrize("steps, waits_ms", [(1.0, 5), (0.0, 20)])
def test_the_cohort_wait_is_at_most_a_step_with_cohort_wait_steps(artifact, steps, waits_ms):
    """Calls of 5 ms: with cohort_wait_steps 1 a member waits for its cohort one call's time
    (5 ms), not the whole cohort wait (20 ms); with 0 (the control) the whole 20 ms."""
    h = Harness(artifact, cohort_wait_s=20 * MS, cohort_wait_steps=steps)
    run = h.rt.run

    def timed_run(entry_name, step):
        h.clock.advance(5 * MS)  # every call takes 5 ms on the fake clock
        return run(entry_name, step)
    h.rt.run = timed_run
    for s in ("a", "b"):
        h.send(s, [1, 2, 3], start=True)
    h.clock.advance(2 * MS)
    assert h.run() == [("prefill_b2_c32", 2)]
    h.send("a", [7])
    h.send("b", [8])
    assert h.run() == [("decode_b2_c32", 2)], "the cohort, complete"
    h.send("a", [9])  # b is late
    h.clock.advance((waits_ms - 1) * MS)
    assert h.run() == [], "a waits for b"
    h.clock.advance(1 * MS)
    assert h.run() == [("decode_b1_c32", 1)], f"a runs alone after {waits_ms} ms"
    assert BatchPolicy(cohort_wait_s=0.02, cohort_wait_steps=2).cohort_wait(0.004) == 0.008
    assert BatchPolicy(cohort_wait_s=0.02, cohort_wait_steps=2).cohort_wait(None) == 0.02
    with pytest.raises(ValueError, match="cohort_wait_steps -1"):
        BatchPolicy(cohort_wait_steps=-1)


def test_a_cohort_runs_together_or_after_the_cohort_wait(artifact):
    h = Harness(artifact, cohort_wait_s=20 * MS)
    for s in ("a", "b"):
        h.send(s, [1, 2, 3], start=True)
    h.clock.advance(2 * MS)
    assert h.run() == [("prefill_b2_c32", 2)], "two prompts of one bucket, one call"
    h.send("a", [7])
    assert h.run() == [], "prompts run together decode together: a waits for b"
    h.send("b", [8])
    assert h.run() == [("decode_b2_c32", 2)]
    h.send("a", [9])
    h.clock.advance(5 * MS)
    assert h.run() == [], "a waits for b, its cohort"
    h.send("b", [10])
    assert h.run() == [("decode_b2_c32", 2)], "both in: one call at once"
    # b's client stops without END: a runs alone after the wait, then without b
    h.send("a", [11])
    h.clock.advance(19 * MS)
    assert h.run() == []
    h.clock.advance(2 * MS)
    assert h.run() == [("decode_b1_c32", 1)]
    h.send("a", [12])
    assert h.run() == [("decode_b1_c32", 1)], "b is no longer in the cohort"
    # a member that ended is not waited for
    h.send("b", [13])
    h.clock.advance(21 * MS)
    h.run()
    h.send("b", [], end=True)
    h.run()
    h.send("a", [14])
    assert h.run() == [("decode_b1_c32", 1)]


def test_prompts_within_the_prefill_wait_merge(artifact):
    h = Harness(artifact, prefill_wait_s=2 * MS)
    h.send("x", [1, 2], start=True)
    h.clock.advance(1 * MS)
    assert h.run() == []
    h.send("y", [3, 4, 5], start=True)
    h.clock.advance(1 * MS)
    assert h.run() == [("prefill_b2_c32", 2)]
    # a full batch of prompts does not wait
    h.send("u", [1], start=True)
    h.send("v", [2], start=True)
    assert h.run() == [("prefill_b2_c32", 2)]
    # different buckets: not merged
    h.send("p", [1, 2], start=True)
    h.send("q", list(range(3, 43)), start=True)
    h.clock.advance(2 * MS)
    # 40 tokens: the 128 context bucket, in its 64-token prefill entry
    assert sorted(h.run()) == [("prefill_b1_c128_t64", 1), ("prefill_b1_c32", 1)]


def test_triton_batching_control_runs_each_execute_call_as_it_came(artifact):
    h = Harness(artifact, backend_batching=False)
    h.batcher.submit_group([Request("a", [1, 2], True, False, lambda r: None),
                            Request("b", [3], True, False, lambda r: None)])
    h.batcher.submit_group([Request("c", [4], True, False, lambda r: None)])
    assert h.run() == [("prefill_b2_c32", 2), ("prefill_b1_c32", 1)]


def fill(h, names, tokens=60):
    """Sequences of `tokens` tokens each (8 pages at 8 tokens a page, room for 4 more), no two
    sharing a block."""
    for i, s in enumerate(names):
        h.send(s, list(range(10 + i, 10 + i + tokens)), start=True)
        h.clock.advance(2 * MS)
        h.run()
        assert h.last(s).error is None


def test_reclaims_only_ended_sequences_least_recently_active_first_as_many_as_needed(artifact):
    h = Harness(artifact, idle_timeout_s=1.0, reclaim_allowance_s=0.5)  # rule: idle > 2.5 s
    fill(h, ["p", "q", "r", "s"])
    assert h.batcher.engine.blocks.full.free == 0
    h.clock.advance(1.0)
    h.send("s", [5])  # s stays active
    h.clock.advance(2 * MS)
    h.run()
    # nobody is past the rule yet: refused by name, nothing reclaimed
    h.send("new", list(range(100, 116)), start=True)  # 2 pages
    h.clock.advance(2 * MS)
    h.run()
    assert h.last("new").code == UNAVAILABLE
    assert "4 sequences hold pages" in h.last("new").error
    assert h.batcher.stats.pages_reclaimed == 0
    # q's client keeps being refused: that is activity, so q is not reclaimed
    h.clock.advance(2.0)
    h.send("q", [999])
    h.run()
    assert h.last("q").code == INVALID_ARG
    h.clock.advance(0.6)  # p and r idle 3.6 s, s 2.6 s, q 0.6 s
    h.send("new", list(range(100, 116)), start=True)
    h.clock.advance(2 * MS)
    h.run()
    assert h.last("new").error is None
    assert set(h.batcher.sequences) == {"q", "r", "s", "new"}, "only p: 8 pages cover 2"
    assert (h.batcher.stats.sequences_reclaimed, h.batcher.stats.pages_reclaimed) == (1, 8)
    # p's client comes back: refused by name, its KV is gone
    h.send("p", [5])
    h.clock.advance(0.1)  # past the cohort wait (s and new are in the cohort)
    h.run()
    assert "not held" in h.last("p").error


def test_control_without_the_rule_a_live_sequence_is_reclaimed(artifact):
    """The same pressure with no idle rule (reclaim anything idle at all): the live sequence p,
    whose client is mid-generation, loses its KV. The rule is what prevents this."""
    h = Harness(artifact, idle_timeout_s=0.0, reclaim_allowance_s=0.0)
    fill(h, ["p", "q", "r", "s"])
    h.clock.advance(0.1)
    h.send("new", list(range(100, 116)), start=True)
    h.clock.advance(2 * MS)
    h.run()
    assert h.last("new").error is None and "p" not in h.batcher.sequences
    h.send("p", [5])
    h.clock.advance(0.1)  # past the cohort wait
    h.run()
    assert "not held" in h.last("p").error


def test_choose_reclaim():
    cands = [("a", 3, 10.0), ("b", 5, 5.0), ("c", 2, 1.0), ("live", 9, 99.0)]
    assert choose_reclaim(cands, need=4, now=100.0, idle_limit=50.0) == ["c", "b"]
    assert choose_reclaim(cands, need=2, now=100.0, idle_limit=50.0) == ["c"]
    assert choose_reclaim(cands, need=11, now=100.0, idle_limit=50.0) == [], \
        "not enough: reclaim nothing"
    assert choose_reclaim(cands, need=1, now=100.0, idle_limit=95.0) == ["c"]


def test_end_without_tokens_for_a_sequence_already_gone_is_acknowledged(artifact):
    """A START refused for a full pool still opened the sequence in Triton: the client closes it
    with END, which must succeed (nothing to free), not be refused."""
    h = Harness(artifact)
    h.send("gone", [], end=True)
    h.run()
    assert h.last("gone").error is None and h.last("gone").kv_pages == (0, 0)


def test_choose_reclaim_covers_every_pool():
    """With a windowed pool, victims must cover the need in both pools."""
    cands = [("a", {"full": 4, "windowed": 0}, 1.0), ("b", {"full": 0, "windowed": 3}, 2.0),
             ("c", {"full": 1, "windowed": 1}, 3.0)]
    assert choose_reclaim(cands, {"full": 2, "windowed": 1}, now=100.0, idle_limit=10.0) == \
        ["a", "b"]
    assert choose_reclaim(cands, {"full": 0, "windowed": 4}, now=100.0, idle_limit=10.0) == \
        ["a", "b", "c"]
    assert choose_reclaim(cands, {"full": 6, "windowed": 0}, now=100.0, idle_limit=10.0) == []


class Queued:
    def __init__(self, seq_id, arrived=0.0, prompt=False, group=1):
        self.seq_id, self.arrived, self.is_prompt, self.group = seq_id, arrived, prompt, group


def test_select_one_request_per_sequence_in_arrival_order():
    pending = [Queued("a"), Queued("b"), Queued("a"), Queued("c")]
    taken, wake = select(pending, now=0.0, policy=BatchPolicy(), cohort=Cohort(set()),
                         held={"a", "b", "c"}, max_prefill_batch=2)
    assert [r.seq_id for r in taken] == ["a", "b", "c"] and taken[0] is pending[0]
    assert wake is None


def test_select_waits_for_a_missing_cohort_member_until_the_deadline():
    policy = BatchPolicy(cohort_wait_s=0.02)
    cohort = Cohort({"a", "b"}, deadline=10.0)
    pending = [Queued("a")]
    assert select(pending, now=9.99, policy=policy, cohort=cohort, held={"a", "b"},
                  max_prefill_batch=2) == ([], 10.0)
    assert select(pending, now=10.0, policy=policy, cohort=cohort, held={"a", "b"},
                  max_prefill_batch=2)[0] == pending
    # a member the model no longer holds is not waited for
    assert select(pending, now=9.0, policy=policy, cohort=cohort, held={"a"},
                  max_prefill_batch=2)[0] == pending


def test_select_holds_prompts_for_the_prefill_wait_unless_the_batch_is_full():
    policy = BatchPolicy(prefill_wait_s=0.002)
    one = [Queued("x", arrived=1.0, prompt=True)]
    args = dict(policy=policy, cohort=Cohort(set()), held=set(), max_prefill_batch=2)
    assert select(one, now=1.001, **args) == ([], 1.002)
    assert select(one, now=1.002, **args)[0] == one
    two = one + [Queued("y", arrived=1.001, prompt=True)]
    assert select(two, now=1.001, **args)[0] == two


def test_select_without_backend_batching_takes_one_execute_call():
    pending = [Queued("a", group=1), Queued("b", group=1), Queued("c", group=2)]
    taken, wake = select(pending, now=0.0, policy=BatchPolicy(backend_batching=False),
                         cohort=Cohort({"z"}, 99.0), held={"z"}, max_prefill_batch=2)
    assert [r.seq_id for r in taken] == ["a", "b"] and wake is None

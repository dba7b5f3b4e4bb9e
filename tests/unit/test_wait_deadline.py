"""A request waiting for pages waits at most preempt_wait_s from the first time it waited: put
back to wait after that (admitted meanwhile, then preempted again before its call ran), it is
refused at once, the refusal naming the time it really waited (scheduling/room.RoomMaker.defer)."""

from __future__ import annotations

from checks.fakes import Harness, fake_artifact
from triton_tlaloc.codes import UNAVAILABLE
from triton_tlaloc.scheduling.admission import Request


def deferred(waited_s: float):
    h = Harness(fake_artifact(), host_bytes=1 << 20, preempt_wait_s=10.0)
    replies = []
    r = Request("a", [1, 2], True, False, replies.append)
    r.waiting_since = h.clock() - waited_s
    return h.batcher.room.defer(r), replies, h.batcher.state.waiting, h.batcher.stats


def test_a_request_put_back_to_wait_past_its_deadline_is_refused_naming_its_wait():
    waits, replies, waiting, stats = deferred(72.8)
    assert not waits and not waiting
    assert replies[0].code == UNAVAILABLE
    assert replies[0].error == ("sequence a: waited 72.8 s for KV pages "
                                "(preempt_wait_microseconds 10000000), preempted again before "
                                "its call ran (retry later)")
    assert stats.refusals == {"pages": 1}


def test_control_within_its_wait_it_waits_on():
    waits, replies, waiting, _ = deferred(9.0)
    assert waits and not replies and [r.seq_id for r in waiting] == ["a"]

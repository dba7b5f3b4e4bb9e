"""client.next_response: generate's wait for its next response is read from the clock, so its
limit holds and its message states the time really waited, however late each poll returns."""

from __future__ import annotations

import queue

import pytest

from triton_tlaloc.frontends import client
from checks.fakes import Clock


class LateQueue:
    """An empty queue whose every get returns `late_s` of the clock after it was asked for
    (a process too busy to wake its thread on time)."""

    def __init__(self, clock: Clock, late_s: float):
        self.clock, self.late_s, self.gets = clock, late_s, 0

    def get(self, timeout):
        self.gets += 1
        self.clock.advance(timeout + self.late_s)
        raise queue.Empty


def counted_polls(responses, timeout_s: float) -> None:
    """The wait as it was: the polls counted, each taken as CANCEL_POLL_S (the control)."""
    waited = 0.0
    while True:
        try:
            return responses.get(timeout=client.CANCEL_POLL_S)
        except queue.Empty:
            waited += client.CANCEL_POLL_S
            if waited >= timeout_s:
                raise TimeoutError(f"m: no response in {timeout_s:.0f} s") from None


def test_the_wait_for_a_response_is_the_clock_s_and_its_message_says_how_long():
    clock = Clock(100.0)
    late = LateQueue(clock, late_s=0.1)  # each poll of 0.05 s returns 0.15 s later
    with pytest.raises(TimeoutError) as e:
        client.next_response(late, lambda: False, 3.0, "m_generate", t0=90.0, count=4,
                             clock=clock)
    waited = clock.t - 100.0
    assert 3.0 <= waited < 3.0 + 0.15 + 1e-9, waited
    assert "no response in 3.0 s after its last response (the limit is 3 s; 13.0 s since " \
           "the request was sent, 4 responses)" in str(e.value)
    # Control: counting polls, the same limit ran three times as long.
    clock = Clock(100.0)
    late = LateQueue(clock, late_s=0.1)
    with pytest.raises(TimeoutError):
        counted_polls(late, 3.0)
    assert clock.t - 100.0 > 8.9


def test_a_set_cancel_ends_the_wait_and_a_queued_response_is_returned():
    clock = Clock()
    late = LateQueue(clock, late_s=0.0)
    asked = []
    assert client.next_response(late, lambda: asked.append(1) or len(asked) > 2, 60.0, "m",
                                clock(), 0, clock=clock) is None
    assert late.gets == 3
    ready: queue.Queue = queue.Queue()
    ready.put(("result", None))
    assert client.next_response(ready, lambda: True, 60.0, "m", 0.0, 0) == ("result", None)

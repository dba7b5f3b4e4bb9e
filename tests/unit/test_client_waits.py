"""client.next_response: generate's wait for its next response is read from the clock, so its
limit holds and its message states the time really waited, however late each poll returns; and
a generation past the limit is cancelled, not waited for."""

from __future__ import annotations

import queue
import sys

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


class SilentStream:
    """tritonclient.grpc's stream as generate uses it, over a generation that sends nothing
    (a prompt still being scored): every stop_stream recorded with its cancel_requests."""

    stops: list[bool] = []

    class InferenceServerClient:
        def __init__(self, url):
            pass

        def start_stream(self, callback):
            pass

        def async_stream_infer(self, model, inputs, **kw):
            pass

        def stop_stream(self, cancel_requests=False):
            SilentStream.stops.append(cancel_requests)

        def close(self):
            pass

    class InferInput:
        def __init__(self, name, shape, dtype):
            pass

        def set_data_from_numpy(self, array):
            pass


def cancelled_first(stops: list[bool]) -> bool:
    """Whether the stream was closed with its request cancelled before anything else."""
    return bool(stops) and stops[0] is True


def test_a_generation_that_times_out_is_cancelled_not_waited_for(monkeypatch):
    """A generation with no response within the limit raises TimeoutError (the front end's
    504) and its request is cancelled: the generation ends at its next step. Closing the
    stream without cancelling waits for the generation to end (a 504 minutes late, the
    scoring run to its end)."""
    import types

    package = types.ModuleType("tritonclient")
    package.grpc = SilentStream
    monkeypatch.setitem(sys.modules, "tritonclient", package)
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", SilentStream)
    SilentStream.stops = []
    with pytest.raises(TimeoutError, match="no response in"):
        client.generate("unused:8001", "m_generate", input_ids=[1, 2], timeout_s=0.1)
    assert cancelled_first(SilentStream.stops), SilentStream.stops
    assert not cancelled_first([False])  # the control: the stream closed as it was

"""A whole completion of n choices whose client goes: every choice is cancelled and its slot
given back within a second, also while choice 0 (streamed inside the server) hands over a piece
every few milliseconds. Through uvicorn in front of a fake `generate` (no Triton)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from triton_tlaloc.frontends import openai_server
from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread
from test_openai_doors import FakeTokenizer, request_bytes, result


class Choices:
    """A generate whose streamed choice hands over a piece every 5 ms and whose others end
    at once; each runs until cancelled (or 20 s)."""

    def __init__(self):
        self.cancels: list[threading.Event] = []
        self.lock = threading.Lock()

    def __call__(self, url, model, *, input_ids, sampling, stream, on_text, cancel):
        with self.lock:
            self.cancels.append(cancel)
        t0 = time.monotonic()
        while stream and not cancel.is_set() and time.monotonic() - t0 < 20:
            on_text("x")
            time.sleep(0.005)
        return result("x", "cancelled" if cancel.is_set() else "length")


def cancelled_within(seconds: float) -> bool:
    """Whether choice 0 of a whole n=4 completion is cancelled within `seconds` of its client
    going, once the other choices have ended."""
    generate = Choices()
    base, stop = serve_in_thread("unused:8001", {"m": ServedModel("m", "m_generate",
                                                                  FakeTokenizer(), 100)},
                                 generate=generate)
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request_bytes("/v1/completions", {"model": "m", "prompt": [5], "n": 4}))
            deadline = time.monotonic() + 10
            while len(generate.cancels) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(generate.cancels) == 4, "the choices did not start"
            time.sleep(0.3)  # the others have ended: choice 0 alone streams inside
        return generate.cancels[0].wait(seconds)
    finally:
        for c in generate.cancels:
            c.set()
        stop()


def test_a_client_gone_from_a_whole_completion_cancels_a_streaming_choice():
    assert cancelled_within(1.0), "choice 0 not cancelled within 1 s of the disconnect"


def test_control_looking_at_the_client_only_between_items_misses_it(monkeypatch):
    """The known-wrong variant: the client looked at only when no item came for a poll."""
    async def idle_only(self, request):
        getter = asyncio.ensure_future(self.items.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=openai_server.DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    raise openai_server.ClientGone
        except BaseException:
            self.abandon()
            raise
        finally:
            getter.cancel()
    monkeypatch.setattr(openai_server.Generation, "next_item", idle_only)
    assert not cancelled_within(1.5)

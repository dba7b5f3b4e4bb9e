"""The reply senders: threads that build and send the responses, off the batcher thread.

A Python-backend response send is a full round trip to Triton's process (~0.5 ms on a busy
2-core machine, whatever the response's size; docs/design.md#what-a-response-send-does). Sent
on the batcher thread, a 64-row decode call's replies took longer than the call, and the next
call could not start before the last was sent. Handed to these threads instead, the batcher
thread goes on at once: the sends of one call overlap each other and the next call.

Each request is answered once, by one thread (a response sender is never shared between
threads). With `threads` 0 every reply is sent on the thread that calls `submit`, as before
these threads existed (the control, and a fallback).

Pure Python: no Triton import; model.py supplies the function that sends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("triton_tlaloc.replies")

# A sender thread's queue item: the send, and when it was queued.
Item = tuple[Callable[[], None], float]


class ReplySenders:
    """`threads` threads that run each submitted send once, in the order submitted (several
    run at once); `stop` sends what is queued, then ends them."""

    def __init__(self, threads: int, on_queued: Callable[[float], None] | None = None):
        if threads < 0:
            raise ValueError(f"reply threads {threads}: expected 0 (send on the batcher "
                             f"thread) or more")
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._on_queued = on_queued  # seconds a reply waited for a thread (a metric)
        self._threads = [threading.Thread(target=self._loop, name=f"tlaloc-reply-{i}",
                                          daemon=True) for i in range(threads)]
        self._stopped = False
        self._lock = threading.Lock()  # a submit is queued before stop's last drain, or run
        for t in self._threads:
            t.start()

    def submit(self, send: Callable[[], None]) -> None:
        """Send a reply: on a sender thread, or here when there is none (or they stopped)."""
        with self._lock:
            queued = bool(self._threads) and not self._stopped
            if queued:
                self._queue.put((send, time.perf_counter()))
        if not queued:
            self._run(send)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            send, queued_at = item
            if self._on_queued is not None:
                self._on_queued(time.perf_counter() - queued_at)
            self._run(send)

    @staticmethod
    def _run(send: Callable[[], None]) -> None:
        try:
            send()
        except Exception:  # a client gone away must not take a sender thread down
            log.exception("sending a reply failed")

    def stop(self, timeout: float = 10.0) -> None:
        """Send every reply queued so far, then end the threads; later replies are sent by the
        caller of `submit`."""
        if self._stopped:
            return
        for _ in self._threads:
            self._queue.put(None)  # after every queued reply: each thread drains to its own
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._stopped = True
        # Anything submitted while the threads were ending (none normally) is sent here.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._run(item[0])

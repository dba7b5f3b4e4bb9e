"""The generate model's side of generations run in the sequence model's process
(generation/local_generation.py; docs/design.md#generation-inside-the-engine).

`LocalLoop` holds the link to the sequence model's process: it sends each request's start (a
frame per batch of requests) and cancellations, and its receiver thread turns the frames of
tokens that come back into each stream's text (`TextStream`: incremental decoding and stop
strings); a stream that gets no tokens for a while (its constraint compiling, its START
waiting) is looked at all the same, so a cancelled one is cancelled. `StreamSenders` sends the
responses: a stream with something new is queued, and whatever it gathered by the time a
sender thread takes it goes out in one response. When the
sends keep up, that is a response per token; when they do not (many streams, a fast step),
responses carry several tokens each instead of falling behind. A stream is sent by one thread
at a time, and the same thread asks Triton whether its request was cancelled (at most every
`CANCEL_CHECK_S`).

Pure Python: the response is built and sent by a function the generate model passes in
(tests/unit/test_local_streams.py drives it with fakes).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..codes import CANCELLED, UNAVAILABLE
from .local_generation import PROMPT_LOGPROBS
from .generation_link import (LinkError, connect, hang_up, instance_link, receive_frame, send_frame)
from .sampling import SamplingParams, TextStream

log = logging.getLogger("triton_tlaloc.generate")

CANCEL_CHECK_S = 0.1  # how often a stream's request is asked whether it was cancelled
RECONNECT_S = 5.0  # how often a generate model without a link tries again


@dataclass
class Outbound:
    """What one response carries: new text and ids, and on the final one its finish reason
    (or the error that ends it)."""

    text: str
    token_ids: list[int]
    finish: str | None = None
    error: tuple[str, str] | None = None  # (code, message)
    logprobs: list | None = None  # one entry a token id, when the request asked for them
    prompt_logprobs: list | None = None  # one entry a prompt token, on the first response

    @property
    def final(self) -> bool:
        return self.finish is not None or self.error is not None


class LocalStream:
    """One request of the generate model, generated in the sequence model's process."""

    def __init__(self, sender, prompt: list[int], params: SamplingParams, streaming: bool,
                 text: TextStream, stops: set[int], arrived: float):
        self.sender, self.prompt, self.params = sender, prompt, params
        self.streaming, self.text, self.stops, self.arrived = streaming, text, stops, arrived
        self.lock = threading.Lock()
        self.pieces: list[str] = []  # not yet sent (all of them when not streaming)
        self.ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None  # until they are sent
        self.generated = 0
        self.finish: str | None = None
        self.error: tuple[str, str] | None = None
        self.scheduled = False
        self.checked = arrived  # when its request was last asked whether it was cancelled
        self.last_token: float | None = None
        self.gen_id = 0  # LocalLoop.start numbers it
        self.loop = None  # the LocalLoop (the instance's link) it runs on

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None

    @property
    def has_output(self) -> bool:
        """Whether a response is due: the final one, or new text and ids when streaming."""
        return self.ended or (self.streaming and bool(self.ids or self.pieces))

    def take(self) -> Outbound | None:
        """What goes out now (under the lock): nothing until the end when not streaming."""
        if not self.has_output:
            return None
        out = Outbound("".join(self.pieces), self.ids, self.finish, self.error, self.logprobs,
                       self.prompt_logprobs)
        self.pieces, self.ids, self.prompt_logprobs = [], [], None
        self.logprobs = None if self.logprobs is None else []
        return out

    def has_news(self, now: float) -> bool:
        return self.has_output or now - self.checked >= CANCEL_CHECK_S


class StreamSenders:
    """Threads that send the streams' responses, each stream by one thread at a time."""

    def __init__(self, threads: int, send: Callable[[LocalStream, Outbound], None],
                 is_cancelled: Callable[[LocalStream], bool],
                 on_cancelled: Callable[[LocalStream], None],
                 clock: Callable[[], float] = time.perf_counter):
        assert threads >= 1
        self.send, self.is_cancelled, self.on_cancelled = send, is_cancelled, on_cancelled
        self.clock = clock
        self._ready: deque[LocalStream] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.threads = [threading.Thread(target=self._run, name=f"tlaloc-stream-send-{i}",
                                         daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def schedule(self, stream: LocalStream) -> None:
        with stream.lock:
            if stream.scheduled:
                return
            stream.scheduled = True
        with self._cv:
            self._ready.append(stream)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """What is queued is sent first."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self.threads:
            t.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._stopping:
                    self._cv.wait()
                if not self._ready:
                    return
                stream = self._ready.popleft()
            self._serve(stream)

    def _serve(self, stream: LocalStream) -> None:
        with stream.lock:
            out = stream.take()
        if out is not None:
            try:
                self.send(stream, out)
            except Exception:  # a client gone away must not take a sender thread down
                log.exception("sending a generate response failed")
            if out.final:
                return  # never scheduled again
        now = self.clock()
        if now - stream.checked >= CANCEL_CHECK_S:
            stream.checked = now
            try:
                cancelled = self.is_cancelled(stream)
            except Exception:
                log.exception("is_cancelled failed")
                cancelled = False
            if cancelled:
                self.on_cancelled(stream)
        with stream.lock:
            stream.scheduled = False
            again = stream.has_output
        if again:
            self.schedule(stream)


class LocalLoop:
    """The link to the sequence model's process and the streams it generates for."""

    def __init__(self, sequence_model: str, senders: StreamSenders,
                 observe_token: Callable[[LocalStream, float], None],
                 on_finished: Callable[[LocalStream], None],
                 server_pid: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 draft_model: str = "", probe: bool = False):
        self.sequence_model, self.senders, self.server_pid = sequence_model, senders, server_pid
        self.probe = probe  # looking for an instance that may not exist: failures are quiet
        self.draft_model = draft_model  # named to generations that draft with a model
        self.observe_token, self.on_finished, self.clock = observe_token, on_finished, clock
        self.streams: dict[int, LocalStream] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the connection's sends, and the streams
        self._conn = None
        self._tried: float | None = None

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    def connected(self) -> bool:
        """Whether the link is up; when it is not, tries to open it (at most every
        RECONNECT_S: the sequence model may still be loading, or runs no local loop)."""
        with self._lock:
            if self._conn is not None:
                return True
            now = self.clock()
            if self._tried is not None and now - self._tried < RECONNECT_S:
                return False
            self._tried = now
            try:
                self._conn = connect(self.sequence_model, self.server_pid)
            except LinkError as e:
                if not self.probe:
                    log.warning("generations go through BLS calls: %s", e)
                return False
            conn = self._conn
        threading.Thread(target=self._receive, args=(conn,), name="tlaloc-link-receive",
                         daemon=True).start()
        threading.Thread(target=self._watch_quiet, args=(conn,), name="tlaloc-link-quiet",
                         daemon=True).start()
        log.info("generations run in %s's process (local link open)", self.sequence_model)
        return True

    def start(self, streams: list[LocalStream]) -> None:
        """Starts the streams' generations (one frame); on a broken link they end with an
        error."""
        commands = []
        with self._lock:
            for s in streams:
                s.gen_id = next(self._ids)
                s.loop = self
                self.streams[s.gen_id] = s
                spec = {"prompt": s.prompt, "sampling": s.params.to_dict(),
                        "stops": sorted(s.stops)}
                if s.params.speculative is not None and self.draft_model:
                    spec["draft_model"] = self.draft_model
                commands.append(["start", s.gen_id, spec])
        self._command(commands)

    def cancel(self, stream: LocalStream) -> None:
        self._command([["cancel", stream.gen_id]])

    def _command(self, commands: list) -> None:
        with self._lock:
            conn = self._conn
            try:
                if conn is None:
                    raise OSError("the link is not open")
                send_frame(conn, commands)
                return
            except (OSError, ValueError) as e:
                error = e
        self._link_lost(conn, f"sending: {error}")

    def _receive(self, conn) -> None:
        while True:
            try:
                events = receive_frame(conn)
            except (EOFError, OSError, ValueError) as e:
                self._link_lost(conn, f"receiving: {e}")
                conn.close()
                return
            for event in events:
                try:
                    self._event(*event)
                except Exception:  # one bad event must not stop the others
                    log.exception("local generation event %s failed", event)

    def _event(self, gen_id: int, token: int, reason: str | None, code: str | None = None,
               message: str | None = None, logprob: list | None = None) -> None:
        with self._lock:
            stream = self.streams.get(gen_id)
            if stream is not None and reason not in (None, PROMPT_LOGPROBS):
                del self.streams[gen_id]  # the sequence model is done with it
        if stream is None:
            return
        with stream.lock:
            if stream.ended:  # ended here already (a stop string): what follows is dropped
                return
            if reason == PROMPT_LOGPROBS:  # they go with the next response
                stream.prompt_logprobs = logprob
                return
            if token >= 0 or reason in ("stop", "length"):
                self.observe_token(stream, self.clock())
            if token >= 0:
                stream.generated += 1
                stream.ids.append(token)
                if stream.logprobs is not None:
                    stream.logprobs.append(logprob)
                piece = stream.text.push(token)
                if stream.text.stopped:
                    stream.finish = "stop"
                elif reason == "length":
                    piece += stream.text.flush()
                stream.pieces.append(piece)
            if not stream.ended:
                if reason == "stop":
                    stream.pieces.append(stream.text.flush())
                    stream.finish = "stop"
                elif reason == "length":
                    stream.finish = "length"
                elif reason == "cancelled":
                    stream.error = (CANCELLED, "the request was cancelled")
                elif reason == "error":
                    stream.error = (code, message)
            stopped_here = stream.finish == "stop" and reason is None
        if stopped_here:  # a stop string: the sequence model stops at its next step
            self.cancel(stream)
        if stream.ended:
            self.on_finished(stream)
        if stream.has_news(self.clock()):
            self.senders.schedule(stream)

    def quiet_streams(self, now: float) -> list[LocalStream]:
        """The streams no event has had asked whether they were cancelled for CANCEL_CHECK_S:
        a generation whose constraint compiles, or whose START waits for pages, sends none."""
        with self._lock:
            return [s for s in self.streams.values() if now - s.checked >= CANCEL_CHECK_S]

    def _watch_quiet(self, conn) -> None:
        """While the link is up: quiet streams go to the senders, which ask whether their
        request was cancelled (and cancel their generation if it was), as a token would."""
        while True:
            time.sleep(CANCEL_CHECK_S)
            with self._lock:
                if self._conn is not conn:
                    return
            for stream in self.quiet_streams(self.clock()):
                self.senders.schedule(stream)

    def _link_lost(self, conn, doing: str) -> None:
        """Every stream the link carried ends with an error; the next request reconnects."""
        with self._lock:
            if conn is not None and self._conn is not conn:
                return
            self._conn = None
            streams, self.streams = list(self.streams.values()), {}
        log.warning("the local generation link to %s was lost (%s): %d generations end",
                    self.sequence_model, doing, len(streams))
        self._end(streams, f"the sequence model {self.sequence_model} went away during the "
                           f"generation")

    def _end(self, streams: list[LocalStream], message: str) -> None:
        for s in streams:
            with s.lock:
                if s.ended:
                    continue
                s.error = (UNAVAILABLE, message)
            self.on_finished(s)
            self.senders.schedule(s)

    def close(self) -> None:
        """The generate model unloads: the link is closed, and every stream still generating
        ends with an error (sent before the senders stop)."""
        with self._lock:
            conn, self._conn = self._conn, None
            streams, self.streams = list(self.streams.values()), {}
        if conn is not None:
            hang_up(conn)  # its receiver thread closes it
        self._end(streams, "the generate model is unloading")


class InstanceLoops:
    """The local links to every instance of a data-parallel sequence model: "NAME", then
    "NAME#1", "NAME#2" ... (generation_link.instance_link), found by trying the next name while
    the last one answers. A generation starts on the instance with the fewest generations, so
    they spread as Triton spreads sequences; a model of one instance has one loop. Has
    LocalLoop's interface."""

    def __init__(self, sequence_model: str, *args, **kw):
        self.sequence_model = sequence_model
        self._make = lambda i: LocalLoop(instance_link(sequence_model, i), *args, **kw,
                                         probe=i > 0)
        self.loops = [self._make(0)]
        self._lock = threading.Lock()

    def connected(self) -> bool:
        """Whether instance 0's link is up (tried as LocalLoop tries); while the last known
        instance answers, the next one is looked for."""
        if not self.loops[0].connected():
            return False
        with self._lock:
            while self.loops[-1].connected():
                self.loops.append(self._make(len(self.loops)))
                if self.loops[-1].connected():
                    log.info("generations spread over %s's instances: %d found",
                             self.sequence_model, len(self.loops))
        return True

    def start(self, streams: list[LocalStream]) -> None:
        up = [loop for loop in self.loops if loop.is_open] or self.loops[:1]
        groups: dict[int, list[LocalStream]] = {}
        live = {id(loop): len(loop.streams) for loop in up}
        for s in streams:
            loop = min(up, key=lambda lp: live[id(lp)])
            live[id(loop)] += 1
            groups.setdefault(id(loop), []).append(s)
        for loop in up:
            if id(loop) in groups:
                loop.start(groups[id(loop)])

    def cancel(self, stream: LocalStream) -> None:
        (stream.loop or self.loops[0]).cancel(stream)

    def close(self) -> None:
        for loop in self.loops:
            loop.close()

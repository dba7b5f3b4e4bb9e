"""Generations run inside the sequence model's process
(docs/design.md#generation-inside-the-engine).

The generate model sends each generation here over the local link (generation_link.py) instead
of making a BLS call per token. Each generation is a sequence of the batcher's with a key no
Triton client can send (`LocalSequenceId`). Its reply function runs on the batching thread:
it chooses the next token from the call's logits (greedy, or `Sampler` with the request's
parameters), and queues the sequence's next step at once, so that the next round finds the whole
cohort queued and never waits for it. The tokens chosen in a round go back to the generate
model in one frame, written by the connection's writer thread when the round ends.

Token-level ends are decided here (an end-of-sequence or stop token id, max_tokens, the largest
context); text-level ones (stop strings) by the generate model, which holds the tokenizer and
cancels the generation. Every generation ends with one event carrying its finish reason, and
its sequence is ENDed (kept for a next turn as a client's would be).

Pure Python over a batcher-like object (`submit_group`): no Triton import here, tested with a
fake batcher (tests/unit/test_local_generation.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .admission import Reply, Request
from .codes import INTERNAL, INVALID_ARG, RequestError
from .frontends.sampling import Sampler, SamplingError, SamplingParams
from .frontends.speculative import Speculator, StepCost, sampled_acceptance
from .generation_link import (LinkError, hang_up, knock, listen, receive_frame,
                              send_frame)

log = logging.getLogger("triton_tlaloc.local_generation")

NO_TOKEN = -1


class LocalSequenceId:
    """The batcher's key of a local generation's sequence: compared by identity, so no
    correlation id a client sends (an integer or a string) can equal it."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number

    def __repr__(self) -> str:
        return f"local-{self.number}"


_numbers = itertools.count(1)


class Generation:
    """One generation: its sequence, its sampler, what it generated so far, and whether its
    generate model cancelled it. `emit(event)` hands an event to the connection's outbox;
    `submit(requests)` queues its next requests for the batcher."""

    def __init__(self, gen_id: int, prompt: list[int], params: SamplingParams, stops: set[int],
                 max_context: int, emit: Callable[[list], None],
                 submit: Callable[[list[Request]], None],
                 speculation: "Speculation | None" = None):
        assert prompt, "a generation needs a prompt"
        self.gen_id, self.prompt, self.params = gen_id, prompt, params
        self.stops, self.max_context = stops, max_context
        self.emit, self.submit = emit, submit
        self.sampler = Sampler(params)
        self.seq_id = LocalSequenceId(next(_numbers))
        self.generated = 0
        self.cancelled = False  # set by the link's reader thread, read by the batching thread
        self.finished = False
        self.speculator = None
        if params.speculative is not None:
            speculation = speculation or Speculation()
            if speculation.refused:
                raise SamplingError(f"sampling parameter speculative: {speculation.refused}")
            self.speculator = Speculator(params.speculative, prompt, speculation.most_drafts,
                                         speculation.cost)

    @property
    def length(self) -> int:
        """The prompt and the tokens generated so far."""
        return len(self.prompt) + self.generated

    def start_request(self) -> Request:
        return Request(seq_id=self.seq_id, tokens=list(self.prompt), start=True, end=False,
                       reply_fn=self.on_reply, cache_salt=self.params.cache_salt)

    def on_reply(self, reply: Reply) -> None:
        """The batcher answered a step (on its thread): choose, emit, queue the next step."""
        assert not self.finished, f"{self.seq_id}: a reply after the generation ended"
        if reply.error is not None:
            self._finish(NO_TOKEN, "error", reply.code or INTERNAL, reply.error)
            return
        if self.cancelled:
            self._finish(NO_TOKEN, "cancelled")
            return
        if reply.accepted_ids is not None:  # a verify call's: the drafts that stood, then one
            tokens = reply.accepted_ids
        elif self.params.greedy:
            tokens = [int(np.argmax(reply.logits))]
        else:
            tokens = [self.sampler.choose(reply.logits)]
        if self.speculator is not None:
            self.speculator.took(tokens)
        for token in tokens:
            if token in self.stops:  # not part of the text
                self._finish(NO_TOKEN, "stop")
                return
            self.generated += 1
            if self.generated >= self.params.max_tokens or self.length >= self.max_context:
                self._finish(token, "length")  # the next token would pass a limit
                return
            self.emit([self.gen_id, token, None])
        self.submit([self._next_step(tokens[-1])])

    def _next_step(self, token: int) -> Request:
        """The request that feeds `token`: with drafts after it when the generation
        speculates and its drafter has some, a verify request."""
        drafts = []
        if self.speculator is not None:
            # Room for the drafts and the token after them within both limits.
            room = min(self.max_context - self.length, self.params.max_tokens - self.generated)
            drafts = self.speculator.drafts(room - 1)
        if not drafts:
            return Request(seq_id=self.seq_id, tokens=[token], start=False, end=False,
                           reply_fn=self.on_reply)
        return Request(seq_id=self.seq_id, tokens=[token] + drafts, start=False, end=False,
                       reply_fn=self.on_reply, draft_tokens=len(drafts), want_logits=False,
                       acceptor=(None if self.params.greedy else
                                 functools.partial(sampled_acceptance, self.sampler)))

    def _finish(self, token: int, reason: str, code: str | None = None,
                message: str | None = None) -> None:
        self.finished = True
        self.emit([self.gen_id, token, reason] + ([code, message] if code else []))
        # END frees the sequence's hold (kept for a next turn while pages allow); an END for a
        # sequence already gone (its START refused) is acknowledged.
        self.submit([Request(seq_id=self.seq_id, tokens=[], start=False, end=True,
                             reply_fn=_ignore)])


def _ignore(reply: Reply) -> None:
    pass


@dataclass(frozen=True)
class Speculation:
    """What the sequence model can verify: the most drafts a step can carry, or why it
    verifies none (a generation asking for speculation is then refused with that reason)."""

    most_drafts: int = 0
    refused: str | None = "the sequence model verifies no drafts"
    cost: StepCost | None = None

    @staticmethod
    def of(engine, entry_seconds: dict[str, float] | None = None) -> "Speculation":
        """What `engine` can verify; `entry_seconds`, each entry's recent call time (the
        batcher's stats), weighs a verify call against a decode call."""
        try:
            engine.check_speculation()
        except RequestError as e:
            return Speculation(0, str(e))
        entries = engine.art.entries

        def seconds(kind: str, tokens: int) -> float | None:
            times = [s for name, s in list((entry_seconds or {}).items())
                     if (e := entries.get(name)) is not None and e.kind == kind
                     and e.tokens_per_seq == tokens]
            return sum(times) / len(times) if times else None
        return Speculation(engine.most_drafts(), None,
                           StepCost(engine.art.verify_tokens, seconds))


class LinkConnection:
    """One generate model's connection: its generations, a reader thread taking commands
    (starts go to the batcher at once), and an outbox its writer thread sends as one frame when
    a batcher round ends (`flush`)."""

    def __init__(self, conn, submit: Callable[[list[Request]], None],
                 queue_next: Callable[[list[Request]], None], max_context: int,
                 on_closed: Callable[["LinkConnection"], None],
                 speculation: Speculation | None = None):
        self.conn, self.submit, self.queue_next = conn, submit, queue_next
        self.max_context, self.on_closed = max_context, on_closed
        self.speculation = speculation or Speculation()
        self.generations: dict[int, Generation] = {}
        self._outbox: list[list] = []
        self._cv = threading.Condition()
        self._flush = False
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="tlaloc-link-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name="tlaloc-link-write",
                                        daemon=True)

    def start(self) -> None:
        self._reader.start()
        self._writer.start()

    def emit(self, event: list) -> None:
        with self._cv:
            self._outbox.append(event)
            if event[2] is not None:
                self.generations.pop(event[0], None)

    def flush(self) -> None:
        with self._cv:
            if self._outbox:
                self._flush = True
                self._cv.notify()

    def close(self) -> None:
        """What is in the outbox goes out, then the connection is closed."""
        with self._cv:
            self.closed = True
            self._cv.notify()
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join(1.0)
        hang_up(self.conn)  # the reader thread closes it

    def _write(self) -> None:
        while True:
            with self._cv:
                # Events from outside a round (the model unloading) go out within 50 ms.
                self._cv.wait_for(lambda: self._flush or self.closed, timeout=0.05)
                events, self._outbox, self._flush = self._outbox, [], False
                closed = self.closed
            if events:
                try:
                    send_frame(self.conn, events)
                except Exception:  # closed under it by the reader (the peer went away)
                    self._lost("writing")
                    return
            if closed:
                return

    def _read(self) -> None:
        while True:
            try:
                commands = receive_frame(self.conn)
            except (EOFError, OSError, ValueError):
                self._lost("reading")
                self.conn.close()
                return
            starts = []
            for command in commands:
                try:
                    started = self._command(command)
                except (SamplingError, KeyError, IndexError, TypeError, ValueError) as e:
                    log.warning("local generation link: a malformed command refused: %s", e)
                    gen_id = (command[1] if isinstance(command, list) and len(command) > 1
                              else None)
                    if isinstance(gen_id, int):
                        self.emit([gen_id, NO_TOKEN, "error", INVALID_ARG,
                                   f"malformed local generation command: {e}"])
                    continue
                if started is not None:
                    starts.append(started)
            if starts:
                self.submit([g.start_request() for g in starts])
            self.flush()

    def _command(self, command: list) -> Generation | None:
        kind, gen_id = command[0], int(command[1])
        if kind == "cancel":
            gen = self.generations.get(gen_id)
            if gen is not None:
                gen.cancelled = True
            return None
        if kind != "start":
            raise ValueError(f"unknown command {kind!r}")
        spec = command[2]
        prompt = [int(t) for t in spec["prompt"]]
        if not prompt or len(prompt) > self.max_context:
            raise ValueError(f"a prompt of {len(prompt)} tokens (1 to {self.max_context})")
        params = SamplingParams.from_dict(spec.get("sampling") or {})
        stops = {int(t) for t in spec.get("stops", ())}  # the generate model's end ids
        gen = Generation(gen_id, prompt, params, stops, self.max_context, self.emit,
                         self.queue_next, self.speculation)
        with self._cv:
            self.generations[gen_id] = gen
        return gen

    def _lost(self, doing: str) -> None:
        """The generate model went away: its generations are cancelled (ended at their next
        step, their pages released)."""
        if not self.closed:
            log.info("local generation link closed (%s): %d generations cancelled", doing,
                     len(self.generations))
        with self._cv:
            self.closed = True
            gens = list(self.generations.values())
            self._cv.notify()
        for g in gens:
            g.cancelled = True
        self.on_closed(self)


class LocalGenerations:
    """The sequence model's side: listens on the local link and runs what connects. The
    batcher calls `round_ended` after each round: the steps its replies queued go to the
    batcher together, and every connection's outbox is flushed."""

    def __init__(self, model_name: str, submit: Callable[[list[Request]], None],
                 max_context: int, server_pid: int | None = None,
                 speculation: Speculation | None = None):
        self.model_name, self.submit, self.max_context = model_name, submit, max_context
        self.speculation = speculation or Speculation()
        self.connections: list[LinkConnection] = []
        self._lock = threading.Lock()
        self._next: list[Request] = []  # steps queued by this round's replies
        self._stopping = False
        self.listener, self.socket_path, self.key_path = listen(model_name, server_pid)
        self._acceptor = threading.Thread(target=self._accept, name="tlaloc-link-accept",
                                          daemon=True)
        self._acceptor.start()
        log.info("local generations: listening at %s (generate models run their loops in "
                 "this process)", self.socket_path)

    @classmethod
    def open(cls, *args, **kw) -> "LocalGenerations | None":
        try:
            return cls(*args, **kw)
        except (LinkError, OSError) as e:
            log.warning("local generations off: %s (generate models use BLS calls)", e)
            return None

    def queue_next(self, requests: list[Request]) -> None:
        """A reply's next step (on the batching thread): submitted when the round ends."""
        with self._lock:
            self._next += requests

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn = self.listener.accept()
            except Exception as e:  # a peer without the key, or the listener closed
                if self._stopping:
                    return
                log.warning("local generation link: a connection refused: %s", e)
                continue
            link = LinkConnection(conn, self.submit, self.queue_next, self.max_context,
                                  self._closed, self.speculation)
            with self._lock:
                self.connections.append(link)
            link.start()
            log.info("local generation link: a generate model connected")

    def _closed(self, link: LinkConnection) -> None:
        with self._lock:
            if link in self.connections:
                self.connections.remove(link)

    def round_ended(self) -> None:
        with self._lock:
            links = list(self.connections)
            queued, self._next = self._next, []
        if queued:
            self.submit(queued)
        for link in links:
            link.flush()

    def stop(self) -> None:
        """After the batcher stopped (every request answered): the last events go out, then
        the listener and its files are removed."""
        self._stopping = True
        self.round_ended()
        knock(self.socket_path)  # wakes the acceptor (closing its socket does not, on Linux)
        with self._lock:
            links = list(self.connections)
        for link in links:
            link.close()
        try:
            self.listener.close()
        except OSError:
            pass
        for p in (self.socket_path, self.key_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


__all__ = ["Generation", "LinkConnection", "LocalGenerations", "LocalSequenceId", "NO_TOKEN",
           "Speculation"]

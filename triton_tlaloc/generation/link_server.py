"""The sequence model's end of the local link (docs/design.md#generation-inside-the-engine):
`LocalGenerations` listens, and a `LinkConnection` per peer reads its commands and writes its
events.

A peer is a generate model, whose generations run here (`["start", ...]`, `["cancel", id]`:
local_generation.Generation), or, when this model serves as a draft model, a target sequence
model's process asking for drafts (`["hello", 0]`, `["draft", ...]`, `["cancel", id]`:
draft_model.DraftSession). Both run on this model's batching thread; what they emit in a round
goes out in one frame when the round ends.

Pure Python over a batcher-like object (`submit_group`): no Triton import here, tested with a
fake batcher and real sockets (tests/unit/test_local_generation.py, test_draft_model.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Callable

from ..scheduling.admission import Request
from ..codes import INVALID_ARG, UNAVAILABLE
from .draft_model import DraftClients, DraftError, DraftSession
from .sampling import SamplingError, SamplingParams
from .generation_link import (LinkError, hang_up, instance_link, knock, listen, receive_frame,
                              send_frame)
from .local_generation import NO_TOKEN, Generation, Speculation
from .grammar import Grammars, GrammarsBusy
from .token_constraint import TokenConstraint

log = logging.getLogger("triton_tlaloc.local_generation")


class LinkConnection:
    """One generate model's connection: its generations, a reader thread taking commands
    (starts go to the batcher at once), and an outbox its writer thread sends as one frame when
    a batcher round ends (`flush`)."""

    def __init__(self, conn, submit: Callable[[list[Request]], None],
                 queue_next: Callable[[list[Request]], None], max_context: int,
                 on_closed: Callable[["LinkConnection"], None],
                 speculation: Speculation | None = None, grammars: Grammars | None = None):
        self.conn, self.submit, self.queue_next = conn, submit, queue_next
        self.max_context, self.on_closed = max_context, on_closed
        self.speculation = speculation or Speculation()
        self.grammars = grammars
        self.generations: dict[int, Generation] = {}
        self.drafts: dict[int, DraftSession] = {}  # a target's draft sequences (draft model)
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
            if len(event) > 2 and isinstance(event[1], int) and event[2] is not None:
                self.generations.pop(event[0], None)  # a generation's last event

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
            requests = []
            for command in commands:
                gen_id = (command[1] if isinstance(command, list) and len(command) > 1
                          else None)
                try:
                    if isinstance(command, list) and command[:1] == ["draft"]:
                        requests.append(self._draft(int(gen_id), command[2]))
                        continue
                    started = self._command(command)
                except SamplingError as e:  # a generation refused by name
                    self.emit([gen_id, NO_TOKEN, "error", INVALID_ARG, str(e)])
                    continue
                except (DraftError, KeyError, IndexError, TypeError, ValueError) as e:
                    log.warning("local generation link: a malformed command refused: %s", e)
                    if isinstance(gen_id, int):
                        message = f"malformed local generation command: {e}"
                        self.emit([gen_id, [], INVALID_ARG, message] if command[0] == "draft"
                                  else [gen_id, NO_TOKEN, "error", INVALID_ARG, message])
                    continue
                if started is not None:
                    requests.append(started.start_request())
            if requests:
                self.submit(requests)
            self.flush()

    def _draft(self, draft_id: int, spec: dict) -> Request:
        """A target's draft command: its session's next request (DraftError: refused)."""
        session = self.drafts.get(draft_id)
        if session is None:
            session = DraftSession(draft_id, self.emit, self.queue_next, self.max_context)
            with self._cv:
                self.drafts[draft_id] = session
        return session.ask(spec)

    def _command(self, command: list) -> Generation | None:
        kind, gen_id = command[0], int(command[1])
        if kind == "cancel":
            gen = self.generations.get(gen_id)
            if gen is not None:
                gen.cancelled = True
                if gen.grammar_ticket is not None and gen.grammar_ticket.cancel():
                    self._end_unstarted(gen, "cancelled")  # its compile dropped, or left
            with self._cv:
                session = self.drafts.pop(gen_id, None)
            if session is not None:
                session.cancel(self.submit)
            return None
        if kind == "hello":  # a target that drafts with this model: what it is
            self.emit([gen_id, {"vocab": self.speculation.vocab, "max_context": self.max_context,
                                "rewinds": self.speculation.rewinds}])
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
                         self.queue_next, self.speculation, str(spec.get("draft_model") or ""),
                         self.submit, self.grammars, grammar_later=True)
        with self._cv:
            self.generations[gen_id] = gen
        if params.structured_output is None:
            return gen
        # Its constraint is made off this thread (the next command may be a plain
        # generation's START); the START is sent once it is, and never if it is refused.
        gen.grammar_ticket = self.grammars.prepare(params.structured_output, stops,
                                                   functools.partial(self._grammar_ready, gen))
        return None

    def _grammar_ready(self, gen: Generation, constraint: TokenConstraint | None,
                       error: Exception | None) -> None:
        """`gen`'s constraint, or why it has none (on a compile thread, or this one when it
        was found compiled): its START goes to the batcher, or it ends unstarted."""
        if error is not None:
            code = UNAVAILABLE if isinstance(error, GrammarsBusy) else INVALID_ARG
            self._end_unstarted(gen, "error", code, str(error))
        elif gen.cancelled or self.closed:
            self._end_unstarted(gen, "cancelled")
        else:
            gen.constraint = constraint
            self.submit([gen.start_request()])

    def _end_unstarted(self, gen: Generation, reason: str, code: str | None = None,
                       message: str | None = None) -> None:
        """A generation that never sent its START ends: its one event (no END to send)."""
        gen.finished = True
        self.emit([gen.gen_id, NO_TOKEN, reason] + ([code, message] if code else []))
        self.flush()

    def _lost(self, doing: str) -> None:
        """The generate model went away: its generations are cancelled (ended at their next
        step, their pages released)."""
        if not self.closed:
            log.info("local generation link closed (%s): %d generations cancelled", doing,
                     len(self.generations))
        with self._cv:
            self.closed = True
            gens = list(self.generations.values())
            sessions, self.drafts = list(self.drafts.values()), {}
            self._cv.notify()
        for g in gens:
            g.cancelled = True
            if g.grammar_ticket is not None:
                g.grammar_ticket.cancel()  # a compile nobody else waits for is dropped
        for session in sessions:
            session.cancel(self.submit)
        self.on_closed(self)


class LocalGenerations:
    """The sequence model's side: listens on the local link and runs what connects. The
    batcher calls `round_ended` after each round: the steps its replies queued go to the
    batcher together, and every connection's outbox is flushed."""

    def __init__(self, model_name: str, submit: Callable[[list[Request]], None],
                 max_context: int, server_pid: int | None = None,
                 speculation: Speculation | None = None, instance: int = 0,
                 grammars: Grammars | None = None):
        """`grammars`: what constrains generations that ask for structured output (None:
        such generations are refused by name)."""
        self.model_name, self.submit, self.max_context = model_name, submit, max_context
        self.grammars = grammars
        self.drafters = DraftClients(server_pid)  # the draft models its generations draft with
        self.speculation = dataclasses.replace(speculation or Speculation(),
                                               drafters=self.drafters)
        self.connections: list[LinkConnection] = []
        self._lock = threading.Lock()
        self._next: list[Request] = []  # steps queued by this round's replies
        self._stopping = False
        self.listener, self.socket_path, self.key_path = listen(
            instance_link(model_name, instance), server_pid)
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
                                  self._closed, self.speculation, self.grammars)
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
        self.drafters.close()
        if self.grammars is not None:
            self.grammars.close()
        try:
            self.listener.close()
        except OSError:
            pass
        for p in (self.socket_path, self.key_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


__all__ = ["LinkConnection", "LocalGenerations"]

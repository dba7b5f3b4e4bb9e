"""Drafts from a second model (docs/design.md#a-draft-model).

A draft model is a smaller model with the target's tokenizer, served as a sequence model of its
own in the same tritonserver. A generation of the target that drafts with it keeps a sequence on
the draft model too, which follows the generation's history: before each step the target asks it
for k tokens, the draft model decodes them greedily on its own batching thread, and the target
verifies them in one call. The draft sequence then holds drafts the target may have rejected;
the next ask cuts it back to what the two agree on (`Request.keep_tokens`, Verifier.rewind) and
appends what the target chose. Greedy ids stay exactly the target's whatever the drafts are; with
sampling, a draft proposed with certainty stands with the target's probability of it
(speculative.sampled_acceptance), so the distribution is the target's too.

Both ends talk over the local link (generation_link.py), the target's process connecting to the
draft model's listener as a generate model does:

- the target first sends `["hello", 0]`, answered `[0, {"vocab": v, "rewinds": bool,
  "max_context": n}]`: a generation is refused by name at its start when the draft model's
  vocabulary is not the target's, or its sequences cannot be cut back (linear attention);
- then `["draft", id, {"keep": n, "tokens": [...], "k": k, "salt": s}]`: keep the first n
  tokens (0: a new sequence, a START of tenant s), append `tokens`, decode k; and
  `["cancel", id]`;
- the draft model answers each draft command with one event, `[id, [d1, ..., dk]]`, or
  `[id, [], code, message]` (the draft sequence is then ended, and the generation goes on
  without drafts).

`DraftSession` is the draft model's side (on its batching thread, like a `Generation`);
`DraftClient` and `ModelDrafter` the target's. Pure Python: no Triton, no JAX.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

import numpy as np

from ..scheduling.admission import Reply, Request
from ..codes import INTERNAL
from .speculative import MAX_DRAFT_TOKENS
from .generation_link import LinkError, connect, hang_up, receive_frame, send_frame
from .local_generation import LocalSequenceId, end_request

log = logging.getLogger("triton_tlaloc.draft_model")

_session_numbers = itertools.count(1)


class DraftError(Exception):
    """A draft command that cannot be taken (named)."""


class DraftSession:
    """The draft model's side of one target generation: a sequence of its batcher, cut back,
    extended and decoded k tokens at a time as the target asks. `emit(event)` answers the
    target; `submit(requests)` queues requests for the batcher."""

    def __init__(self, draft_id: int, emit: Callable[[list], None],
                 submit: Callable[[list[Request]], None], max_context: int):
        self.draft_id, self.emit, self.submit = draft_id, emit, submit
        self.max_context = max_context
        self.seq_id = LocalSequenceId(next(_session_numbers))
        self.length = 0  # tokens its sequence holds (its next request's, once admitted)
        self.wanted = 0
        self.drafts: list[int] = []
        self.busy = self.cancelled = self.ended = False
        self._lock = threading.Lock()

    def ask(self, spec: dict) -> Request:
        """A draft command (on the link's reader thread): the request that starts it, or
        DraftError naming what is wrong with it."""
        keep, k = int(spec["keep"]), int(spec["k"])
        tokens = [int(t) for t in spec["tokens"]]
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise DraftError(f"k {k}: expected 1 to {MAX_DRAFT_TOKENS}")
        if not tokens or not 0 <= keep <= self.length or (self.length == 0 and keep):
            raise DraftError(f"keep {keep} of {self.length} tokens and append {len(tokens)}: "
                             f"expected to keep at most what the sequence holds and append some")
        with self._lock:
            if self.busy or self.ended:
                raise DraftError("a draft asked for while the last is drafting, or after the "
                                 "session ended")
            self.busy, self.wanted, self.drafts = True, k, []
        start, cut = self.length == 0, keep < self.length
        self.length = keep + len(tokens)
        return Request(seq_id=self.seq_id, tokens=tokens, start=start, end=False,
                       reply_fn=self.on_reply, cache_salt=spec.get("salt"),
                       keep_tokens=keep if cut and not start else None)

    def on_reply(self, reply: Reply) -> None:
        """A step answered (on the batching thread): the next draft, and the next step or the
        answer."""
        if reply.error is not None:
            self._end([self.draft_id, [], reply.code or INTERNAL, reply.error])
            return
        if self.cancelled:
            self._end(None)
            return
        token = int(np.argmax(reply.logits))
        self.drafts.append(token)
        if len(self.drafts) < self.wanted and self.length < self.max_context:
            self.length += 1
            self.submit([Request(seq_id=self.seq_id, tokens=[token], start=False, end=False,
                                 reply_fn=self.on_reply)])
            return
        with self._lock:
            self.busy = False
            ended = self.ended
        if not ended:
            self.emit([self.draft_id, self.drafts])

    def cancel(self, submit_now: Callable[[list[Request]], None]) -> None:
        """The target's generation ended (on the link's reader thread): the sequence is ENDed,
        now when it is idle, else when its step comes back."""
        with self._lock:
            self.cancelled = True
            idle = not self.busy and not self.ended
            if idle:
                self.ended = True
        if idle and self.length:
            submit_now([end_request(self.seq_id)])

    def _end(self, event: list | None) -> None:
        with self._lock:
            self.ended, self.busy = True, False
        if event is not None:
            self.emit(event)
        self.submit([end_request(self.seq_id)])


class DraftClient:
    """The target process's connection to one draft model, shared by the generations that
    draft with it: asks go out as frames, answers are handed to each ask's callback on the
    reader thread. A lost connection answers every open ask with an error."""

    HELLO_TIMEOUT_S = 10.0

    def __init__(self, model_name: str, server_pid: int | None = None):
        self.model_name = model_name
        self.conn = connect(model_name, server_pid)  # LinkError when it does not listen
        self.closed = False
        self._waiting: dict[int, Callable[[list[int], str | None], None]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.about: dict = {}  # what the draft model says of itself: vocab, rewinds
        hello = threading.Event()
        self._waiting[0] = lambda about, error: (self.about.update(about or {}), hello.set())
        threading.Thread(target=self._read, name="tlaloc-draft-read", daemon=True).start()
        send_frame(self.conn, [["hello", 0]])
        if not hello.wait(self.HELLO_TIMEOUT_S) or not self.about:
            self.close()
            raise LinkError(f"{model_name} did not say what it is within "
                            f"{self.HELLO_TIMEOUT_S:.0f} s")
        log.info("draft model %s: connected (%s)", model_name, self.about)

    def new_id(self) -> int:
        return next(self._ids)

    def ask(self, draft_id: int, spec: dict,
            answer: Callable[[list[int], str | None], None]) -> None:
        """Sends a draft command; `answer(drafts, error)` is called once, on another thread."""
        with self._lock:
            if self.closed:
                error = f"draft model {self.model_name}: its connection is closed"
            else:
                self._waiting[draft_id] = answer
                error = None
                try:
                    send_frame(self.conn, [["draft", draft_id, spec]])
                except OSError as e:
                    del self._waiting[draft_id]
                    error = f"draft model {self.model_name}: sending failed: {e}"
        if error is not None:
            answer([], error)

    def cancel(self, draft_id: int) -> None:
        with self._lock:
            self._waiting.pop(draft_id, None)
            if not self.closed:
                try:
                    send_frame(self.conn, [["cancel", draft_id]])
                except OSError:
                    pass

    def close(self) -> None:
        hang_up(self.conn)  # the reader closes it and answers what waits

    def _read(self) -> None:
        while True:
            try:
                events = receive_frame(self.conn)
            except (EOFError, OSError, ValueError):
                break
            for event in events:
                with self._lock:
                    answer = self._waiting.pop(event[0], None)
                if answer is None:
                    continue
                if len(event) > 2:
                    answer([], f"draft model {self.model_name}: {event[3]}")
                elif isinstance(event[1], dict):  # the answer to hello
                    answer(event[1], None)
                else:
                    answer([int(t) for t in event[1]], None)
        with self._lock:
            self.closed = True
            waiting, self._waiting = self._waiting, {}
        self.conn.close()
        log.info("draft model %s: connection closed (%d drafts unanswered)", self.model_name,
                 len(waiting))
        for answer in waiting.values():
            answer([], f"draft model {self.model_name}: the connection was lost")


class DraftClients:
    """The target process's draft clients by model name, opened at first use and opened again
    after a connection was lost."""

    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid
        self._clients: dict[str, DraftClient] = {}
        self._lock = threading.Lock()

    def drafter(self, model_name: str, prompt: list[int], vocab: int,
                salt: str | None = None) -> "ModelDrafter":
        """A generation's drafter on `model_name`, or LinkError naming why there is none: the
        model cannot be reached, has another vocabulary, or cannot cut its sequences back."""
        client = self.client(model_name)
        if client.about.get("vocab") != vocab:
            raise LinkError(f"draft model {model_name} has a vocabulary of "
                            f"{client.about.get('vocab')} tokens, this model {vocab}: a draft "
                            f"model shares its target's tokenizer")
        if not client.about.get("rewinds"):
            raise LinkError(f"draft model {model_name} cannot cut its sequences back (its "
                            f"linear-attention state folds in every token): it cannot draft")
        return ModelDrafter(client, prompt, salt)

    def client(self, model_name: str) -> DraftClient:
        """The client of `model_name`, or LinkError naming why it cannot be reached."""
        with self._lock:
            client = self._clients.get(model_name)
            if client is None or client.closed:
                try:
                    client = DraftClient(model_name, self.server_pid)
                except LinkError as e:
                    raise LinkError(f"draft model {model_name} cannot be reached (is it loaded "
                                    f"in this server?): {e}") from None
                self._clients[model_name] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


class ModelDrafter:
    """One generation's draft sequence as the target sees it: what the draft model's sequence
    holds (`held`: the history when last asked, and the drafts fed after it), so an ask sends
    only what differs; and how long drafts take (`seconds_per_draft`, a moving average)."""

    def __init__(self, client: DraftClient, prompt: list[int], salt: str | None = None):
        self.client, self.salt = client, salt
        self.draft_id = client.new_id()
        self.history = list(prompt)  # the generation's tokens: the prompt, then what it took
        self.held: list[int] = []
        self.agreed = 0  # leading tokens known equal in `held` and `history`
        self.seconds_per_draft: float | None = None
        self.failed: str | None = None
        self.asks = 0

    def took(self, tokens: list[int]) -> None:
        self.history += tokens

    def ask(self, k: int, answer: Callable[[list[int]], None]) -> None:
        """Asks for k drafts after the history; `answer(drafts)` gets them ([] when the draft
        model failed: this drafter then stays off, `failed` says why)."""
        n = self.agreed
        limit = min(len(self.held), len(self.history))
        while n < limit and self.held[n] == self.history[n]:
            n += 1
        if n == len(self.history):  # the whole history is held: its last token is fed
            n -= 1                    # again, for the logits after it
        spec = {"keep": n, "tokens": self.history[n:], "k": k}
        if not self.asks:
            spec["salt"] = self.salt
        asked_at, history = time.perf_counter(), list(self.history)
        self.asks += 1

        def drafted(drafts: list[int], error: str | None) -> None:
            if error is not None:
                self.failed = error
                log.info("a generation's draft model failed (it decodes plainly now): %s",
                         error)
                answer([])
                return
            # The draft model fed every draft but the last.
            self.held, self.agreed = history + drafts[:-1], len(history)
            per = (time.perf_counter() - asked_at) / max(1, len(drafts))
            self.seconds_per_draft = per if self.seconds_per_draft is None else (
                0.8 * self.seconds_per_draft + 0.2 * per)
            answer(drafts)
        self.client.ask(self.draft_id, spec, drafted)

    def close(self) -> None:
        if self.asks:
            self.client.cancel(self.draft_id)


__all__ = ["DraftClient", "DraftClients", "DraftError", "DraftSession", "ModelDrafter"]

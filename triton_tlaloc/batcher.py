"""The backend's own batching thread: requests in, entry calls on the engine, one reply each.

Triton hands every request over at once (max_queue_delay_microseconds 0) and execute() returns
without waiting; this thread forms the calls. Each round takes the requests waiting (at most one
per sequence, in arrival order), admits each (validate, reserve pages: a refusal changes
nothing), then runs the decode requests of several sequences as one decode call on the smallest
entry that holds them, and the prompts (START) and multi-token continuations as prefill calls,
merging prompts of one context bucket into one call. Every request gets exactly one reply: its
logits, or a typed error naming the problem.

Pure Python over an `Engine`: no Triton import, so it is tested without a server (with an
injected clock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .engine import Engine, RequestError, Sequence
from .pages import PagesExhausted

log = logging.getLogger("triton_tlaloc.batcher")

INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"

# Calls logged one by one at INFO at the start; later ones only in the counters.
LOGGED_CALLS = 20


@dataclass
class Reply:
    logits: np.ndarray | None = None  # [vocab] f32
    kv_pages: tuple[int, int] | None = None  # pages held in the full and the windowed pool
    error: str | None = None
    code: str | None = None  # INVALID_ARG | UNAVAILABLE | INTERNAL when error is set


@dataclass
class Request:
    seq_id: int | str
    tokens: list[int]
    start: bool
    end: bool
    reply_fn: Callable[[Reply], None]
    arrived: float = 0.0
    _answered: bool = field(default=False, repr=False)

    def reply(self, reply: Reply) -> None:
        assert not self._answered, f"sequence {self.seq_id}: a request answered twice"
        self._answered = True
        try:
            self.reply_fn(reply)
        except Exception:  # a client gone away must not stop the thread
            log.exception("sequence %s: sending the reply failed", self.seq_id)


@dataclass
class _Job:
    request: Request
    seq: Sequence
    num_tokens: int  # the sequence's tokens before this request (for rollback)
    num_pages: int


@dataclass
class BatcherStats:
    calls: dict = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    rows: dict = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    refusals: dict = field(default_factory=dict)
    replies: int = 0


class Batcher:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.clock = clock
        self.sequences: dict[int | str, Sequence] = {}
        self.stats = BatcherStats()
        self._pending: deque[Request] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        art = engine.art
        self.max_decode_batch = max((e.batch for e in art.entries.values()
                                     if e.kind == "decode" and e.name in engine.rt.executables),
                                    default=1)
        self.max_prefill_batch = max((e.batch for e in art.entries.values()
                                      if e.kind == "prefill" and e.name in engine.rt.executables),
                                     default=1)
        self.context_ladder = sorted(art.context_ladder)

    # ------------------------------------------------------------ thread

    def submit(self, request: Request) -> None:
        """Called from Triton's execute(): queue and return at once."""
        request.arrived = self.clock()
        with self._cv:
            if self._stopping:
                request.reply(Reply(error="the model is unloading", code=UNAVAILABLE))
                return
            self._pending.append(request)
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tlaloc-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:
            leftover = list(self._pending)
            self._pending.clear()
        for r in leftover:
            r.reply(Reply(error="the model is unloading", code=UNAVAILABLE))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                taken = self._take()
            try:
                self.process(taken)
            except Exception:  # never leave a request unanswered, never let the thread die
                log.exception("batcher round failed")
                for r in taken:
                    if not r._answered:
                        r.reply(Reply(error="internal error in the batcher (see the server "
                                            "log)", code=INTERNAL))

    def _take(self) -> list[Request]:
        """The waiting requests, at most one per sequence (a sequence's later requests stay
        queued, in order, for the next round)."""
        taken, seen, keep = [], set(), deque()
        while self._pending:
            r = self._pending.popleft()
            if r.seq_id in seen:
                keep.append(r)
            else:
                seen.add(r.seq_id)
                taken.append(r)
        self._pending = keep
        return taken

    def run_pending(self) -> None:
        """One round on whatever is queued, on the caller's thread (tests)."""
        with self._cv:
            taken = self._take()
        self.process(taken)

    # ------------------------------------------------------------ one round

    def process(self, requests: list[Request]) -> None:
        decode, prefill = [], []
        for r in requests:
            job = self._admit(r)
            if job is None:
                continue
            if not r.start and len(job.seq.token_ids) - job.seq.num_cached == 1:
                decode.append(job)
            else:
                prefill.append(job)
        for i in range(0, len(decode), self.max_decode_batch):
            self._run("decode", decode[i:i + self.max_decode_batch])
        for group in self._prefill_groups(prefill):
            self._run("prefill", group)

    def _refuse(self, r: Request, code: str, reason: str, message: str) -> None:
        self.stats.refusals[reason] = self.stats.refusals.get(reason, 0) + 1
        log.info("sequence %s refused (%s): %s", r.seq_id, reason, message)
        r.reply(Reply(error=message, code=code))

    def _admit(self, r: Request) -> _Job | None:
        engine = self.engine
        if r.start:
            old = self.sequences.pop(r.seq_id, None)
            if old is not None:
                # A new START on a held id begins a new sequence: the old KV must never be
                # continued, whether or not this START is admitted.
                log.info("sequence %s: START on a held id; its %d pages are released", r.seq_id,
                         len(old.pages))
                engine.free(old)
            seq = Sequence([], seq_id=r.seq_id)
        else:
            seq = self.sequences.get(r.seq_id)
            if seq is None:
                self._refuse(r, INVALID_ARG, "unknown_sequence",
                             f"sequence {r.seq_id} is not held by the model: send its first "
                             f"request with START (it may have ended or been reclaimed)")
                return None
        seq.last_active = self.clock()  # a refused request counts as activity too
        if not r.tokens:
            if r.end and not r.start:
                self._release(seq)
                r.reply(Reply(kv_pages=(0, 0)))
                return None
            self._refuse(r, INVALID_ARG, "empty", f"sequence {r.seq_id}: TOKENS is empty")
            return None
        before = (len(seq.token_ids), len(seq.pages))
        try:
            engine.admit(seq, r.tokens)
        except RequestError as e:
            self._refuse(r, INVALID_ARG, e.reason, f"sequence {r.seq_id}: {e}")
            return None
        except PagesExhausted as e:
            holders = ", ".join(f"{s.seq_id} ({len(s.pages)} pages)"
                                for s in self.sequences.values() if s.pages) or "none"
            self._refuse(r, UNAVAILABLE, "pages",
                         f"sequence {r.seq_id}: KV pool full: {e}; sequences holding pages: "
                         f"{holders}")
            return None
        if r.start:
            self.sequences[r.seq_id] = seq
        return _Job(r, seq, *before)

    def _prefill_groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Prompts of one context bucket run as one call, up to the largest prefill batch;
        prompts of different buckets are not merged (a call computes every row at its entry's
        context). A prompt longer than the largest prefill entry runs alone, in chunks."""
        by_bucket: dict[int, list[_Job]] = {}
        alone = []
        for job in jobs:
            n = len(job.seq.token_ids) - job.seq.num_cached
            if n > self.engine.max_prefill_tokens:
                alone.append([job])
                continue
            end = len(job.seq.token_ids)
            bucket = next(c for c in self.context_ladder if c >= end)
            by_bucket.setdefault(bucket, []).append(job)
        groups = []
        for bucket in sorted(by_bucket):
            js = by_bucket[bucket]
            groups += [js[i:i + self.max_prefill_batch]
                       for i in range(0, len(js), self.max_prefill_batch)]
        return groups + alone

    def _run(self, kind: str, jobs: list[_Job]) -> None:
        seqs = [j.seq for j in jobs]
        t0 = self.clock()
        try:
            if kind == "decode":
                logits = self.engine.decode(seqs)
            elif len(seqs) == 1 and len(seqs[0].token_ids) - seqs[0].num_cached > \
                    self.engine.max_prefill_tokens:
                logits = self.engine.prefill_chunked(seqs[0])
            else:
                logits = self.engine.prefill(seqs)
        except Exception as e:
            log.exception("%s call for sequences %s failed", kind, [s.seq_id for s in seqs])
            for j in jobs:
                self.engine.rollback(j.seq, j.num_tokens, j.num_pages)
                if j.request.start:
                    self.sequences.pop(j.seq.seq_id, None)
                    self.engine.free(j.seq)
                j.request.reply(Reply(error=f"sequence {j.seq.seq_id}: the {kind} call failed: "
                                            f"{type(e).__name__}: {e}", code=INTERNAL))
            return
        n_calls = sum(self.stats.calls.values())
        self.stats.calls[kind] += 1
        self.stats.rows[kind] += len(jobs)
        if n_calls < LOGGED_CALLS:
            log.info("%s call: %d rows (sequences %s) in %.1f ms", kind, len(jobs),
                     [s.seq_id for s in seqs], (self.clock() - t0) * 1e3)
        for j, row in zip(jobs, logits):
            seq = j.seq
            pages = (len(seq.pages), 0)
            if j.request.end:
                self._release(seq)
            self.stats.replies += 1
            j.request.reply(Reply(logits=row, kv_pages=pages))

    def _release(self, seq: Sequence) -> None:
        if self.sequences.get(seq.seq_id) is seq:
            del self.sequences[seq.seq_id]
        self.engine.free(seq)

"""The backend's own batching thread: requests in, entry calls on the engine, one reply each.

Triton hands every request over at once (max_queue_delay_microseconds 0) and execute() returns
without waiting. This thread takes rounds: `policy.select` says which queued requests run now
(decode cohorts, merged prompts; docs/design.md#batching), then each is admitted and the calls
are run:

- Admission. Each request is validated and its pages (and, for a hybrid model, its state slot)
  reserved before any call; a refusal changes nothing. When pages or slots run short they are
  reclaimed only from sequences Triton has already ended (idle longer than
  `BatchPolicy.reclaim_after_s`: Triton sends no END for a sequence it times out), least
  recently active first, only as many as needed (`policy.choose_reclaim`). With the host tier,
  idle live sequences are then swapped out to host memory, busy ones preempted, and a request
  that still cannot run waits for pages (room.py); otherwise the request is refused by name. A
  refused request still counts as activity. No live sequence's KV is ever lost.
- Calls. Decode rows of several sequences go into one decode call on the smallest entry that
  holds them; prompts of one context bucket into one prefill call (a call computes every row at
  its entry's context, so buckets are not merged); a prompt longer than the largest prefill
  entry runs alone, in chunks. A call that fails is rolled back row by row.
- Every request gets exactly one reply: its logits, or an error with a code naming the problem.

Pure Python over an `Engine`: no Triton or JAX import here, so it is tested with a fake clock
and a fake runtime (tests/unit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .codes import INTERNAL, INVALID_ARG, UNAVAILABLE
from .engine import Engine, RequestError, Sequence
from .host_tier import HostTier
from .metrics import BatcherStats, CallTiming, Observer
from .pages import PagesExhausted, Reuse
from .policy import BatchPolicy, Cohort, select
from .room import RoomMaking

log = logging.getLogger("triton_tlaloc.batcher")


# Calls logged one by one at INFO at the start; later ones only in the counters and metrics.
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
    group: int = 0  # the execute() call it came in (backend_batching off)
    # (reason, message) when the front end refused it already (TOKENS too long to convert):
    # it still passes admission's START and activity rules, then is refused with this.
    refusal: tuple[str, str] | None = None
    cache_salt: str | None = None  # a START's tenant: prompts of different salts share no KV
    waiting_since: float | None = None  # when it first waited for pages (host tier on)
    _answered: bool = field(default=False, repr=False)

    @property
    def is_decode(self) -> bool:
        """One token for a held sequence: a decode step (everything else runs as a prompt)."""
        return not self.start and len(self.tokens) == 1

    @property
    def is_prompt(self) -> bool:
        return self.start or len(self.tokens) > 1

    def reply(self, reply: Reply) -> None:
        assert not self._answered, f"sequence {self.seq_id}: a request answered twice"
        self._answered = True
        try:
            self.reply_fn(reply)
        except Exception:  # a client gone away must not stop the thread
            log.exception("sequence %s: sending the reply failed", self.seq_id)


@dataclass
class Job:
    """A request admitted in this round, and its sequence as it was before (for rollback)."""

    request: Request
    seq: Sequence
    num_tokens: int  # the sequence's tokens before this request (for rollback)
    num_pages: int
    num_ring: int
    had_state_slot: bool


class Batcher(RoomMaking):
    def __init__(self, engine: Engine, policy: BatchPolicy = BatchPolicy(),
                 clock: Callable[[], float] = time.monotonic,
                 observers: tuple[Observer, ...] = (), host_tier: HostTier | None = None,
                 preempt_wait_s: float = 10.0):
        self.engine = engine
        self.policy = policy
        self.clock = clock
        # The host tier (None: off). With it, a request short of pages swaps idle sequences
        # out, preempts, or waits up to preempt_wait_s, instead of being refused.
        self.host = host_tier
        self.preempt_wait_s = preempt_wait_s
        self._waiting: list[Request] = []  # requests waiting for pages, oldest first
        self._retry_waiting = False  # pages were released since they last tried
        self._busy: set = set()  # ids with a request in the round, queued or waiting
        self._admissions = 0  # STARTs admitted so far (Sequence.admitted)
        self.sequences: dict[int | str, Sequence] = {}
        self.stats = BatcherStats()
        self._observers = [self.stats, *observers]
        self._admit_seconds = 0.0  # admission of the current round's requests
        self._pending: deque[Request] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._groups = 0
        self.cohort = Cohort(set())  # the previous decode batch's sequences (policy.py)
        self._evicted = (0, 0)  # cached pages evicted, ended sequences dropped, so far
        # Of every entry, compiled or compiling (the engine splits a call while its entry
        # compiles).
        entries = engine.art.entries.values()
        self.max_decode_batch = max((e.batch for e in entries if e.kind == "decode"), default=1)
        self.max_prefill_batch = max((e.batch for e in entries if e.kind == "prefill"), default=1)
        self.context_ladder = sorted(engine.art.context_ladder)

    def _observe(self, method: str, *args) -> None:
        for o in self._observers:
            try:
                getattr(o, method)(*args)
            except Exception:  # metrics must never take the batcher down
                log.exception("observer %s.%s failed", type(o).__name__, method)

    # ------------------------------------------------------------ thread

    def submit(self, request: Request) -> None:
        self.submit_group([request])

    def submit_group(self, requests: list[Request]) -> None:
        """Called from Triton's execute() with the requests of one call: queue and return."""
        now = self.clock()
        with self._cv:
            self._groups += 1
            for r in requests:
                r.arrived = now
                r.group = self._groups
            if self._stopping:
                for r in requests:
                    r.reply(Reply(error="the model is unloading", code=UNAVAILABLE))
                return
            self._pending.extend(requests)
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
                while True:
                    if self._stopping:
                        return
                    now = self.clock()
                    taken, wake_at = self._select(now)
                    sweep_at = self._sweep_at()
                    if taken or (sweep_at is not None and now >= sweep_at):
                        break
                    wake_at = min((t for t in (wake_at, sweep_at) if t is not None),
                                  default=None)
                    self._cv.wait(None if wake_at is None else max(0.0, wake_at - now))
            try:
                self._sweep(now)
                if taken:
                    self.process(taken)
            except Exception:  # never leave a request unanswered, never let the thread die
                log.exception("batcher round failed")
                for r in taken:
                    if not r._answered:
                        r.reply(Reply(error="internal error in the batcher (see the server "
                                            "log)", code=INTERNAL))

    def run_pending(self) -> bool:
        """One round on the caller's thread if one is due now (tests drive the clock)."""
        now = self.clock()
        with self._cv:
            taken, _ = self._select(now)
        self._sweep(now)
        if taken:
            self.process(taken)
        return bool(taken)

    # ------------------------------------------------------------ what runs when

    def _select(self, now: float) -> tuple[list[Request], float | None]:
        """Take the requests `policy.select` runs now off the queue (called with the lock
        held); returns them and when to look again if some wait."""
        waiting = {r.seq_id for r in self._waiting}
        # A swapped-out sequence is not waited for by its cohort; a sequence whose request
        # waits for pages sends no other.
        held = (self.sequences if self.host is None or not self.host.sequences else
                {k for k, s in self.sequences.items() if s.swapped is None})
        taken, wake_at = select([r for r in self._pending if r.seq_id not in waiting], now=now,
                                policy=self.policy, cohort=self.cohort, held=held,
                                max_prefill_batch=self.max_prefill_batch)
        if taken:
            ids = {id(r) for r in taken}
            self._pending = deque(r for r in self._pending if id(r) not in ids)
        if self._waiting:
            # Waiting requests try again first (before newer ones take the pages) in every
            # round, and alone when pages were released since they last tried or at their
            # deadline.
            due = min(r.waiting_since for r in self._waiting) + self.preempt_wait_s
            if taken or self._retry_waiting or now >= due:
                taken, self._waiting, self._retry_waiting = self._waiting + taken, [], False
            else:
                wake_at = due if wake_at is None else min(wake_at, due)
        return taken, wake_at

    # ------------------------------------------------------------ one round

    def process(self, requests: list[Request]) -> None:
        if self.host is not None:  # who may not be swapped out as idle (room.py)
            with self._cv:
                queued = {r.seq_id for r in self._pending}
            self._busy = ({r.seq_id for r in requests} | queued
                          | {r.seq_id for r in self._waiting})
        jobs: list[Job] = []  # a preempted sequence's job leaves the list
        t0 = time.perf_counter()
        for r in requests:
            job = self._admit(r, jobs)
            if job is not None:
                jobs.append(job)
        decode = [j for j in jobs if j.request.is_decode]
        prefill = [j for j in jobs if not j.request.is_decode]
        self._admit_seconds = time.perf_counter() - t0  # charged to the round's first call
        if decode:
            for i in range(0, len(decode), self.max_decode_batch):
                self._run("decode", decode[i:i + self.max_decode_batch])
            self.cohort = Cohort({j.seq.seq_id for j in decode if not j.request.end},
                                 self.clock() + self.policy.cohort_wait_s)
        for group in self._prefill_groups(prefill):
            self._run("prefill", group)
        if prefill:
            # A sequence whose prompt just ran decodes next: it joins the cohort, so prompts
            # sent together decode together from their first step.
            self.cohort = Cohort(self.cohort.members | {j.seq.seq_id for j in prefill
                                                        if j.seq.seq_id in self.sequences},
                                 self.clock() + self.policy.cohort_wait_s)
        self._observe("state", self.pool_state(), len(self.sequences))
        if self.host is not None:
            self._observe("host", self.host.used, self.host.sequences, self.host.cached_bytes)
        blocks = self.engine.blocks
        evicted = (blocks.full.evicted - self._evicted[0], blocks.dropped - self._evicted[1])
        if any(evicted):
            self._evicted = (blocks.full.evicted, blocks.dropped)
            self._observe("evicted", *evicted)

    def pool_state(self) -> dict[str, tuple[int, int, int]]:
        """Per pool: (held by live sequences, cached, free) (pages.BlockManager.usage)."""
        return self.engine.blocks.usage()

    def _holding(self, s: Sequence) -> str:
        ring = f", {len(s.ring)} ring pages" if self.engine.blocks.rings is not None else ""
        slot = (f", state slot {s.state_slot}" if s.state_slot is not None else "")
        return f"{s.seq_id} ({len(s.pages)} pages{ring}{slot})"

    def _refuse(self, r: Request, code: str, reason: str, message: str) -> None:
        self._observe("refusal", reason)
        log.info("sequence %s refused (%s): %s", r.seq_id, reason, message)
        r.reply(Reply(error=message, code=code))

    def _refuse_exhausted(self, r: Request, e: PagesExhausted) -> None:
        """A request refused for want of pages or state slots. Who holds them goes to the
        server log only: a correlation id is the only capability a sequence has, so no client
        may learn another's; the client hears how many sequences hold them."""
        holding = [s for s in self.sequences.values() if any(s.holding.values())]
        log.info("sequence %s: %s; holders: %s", r.seq_id, e,
                 ", ".join(self._holding(s) for s in holding) or "none")
        if e.pools == ("state",):
            self._refuse(r, UNAVAILABLE, "state_slots",
                         f"sequence {r.seq_id}: no free linear-attention state slot: {e}; "
                         f"{len(holding)} sequences hold slots (retry when one ends)")
        else:
            self._refuse(r, UNAVAILABLE, "pages",
                         f"sequence {r.seq_id}: KV pool full: {e}; {len(holding)} sequences "
                         f"hold pages (retry when one ends)")

    def _admit(self, r: Request, jobs: list[Job]) -> Job | None:
        engine = self.engine
        if r.start:
            old = self.sequences.get(r.seq_id)
            if old is not None:
                # A new START on a held id begins a new sequence: the old KV must never be
                # continued by this id, whether or not this START is admitted. (Ended whole,
                # another prompt of the same history may still take it over.)
                log.info("sequence %s: START on a held id; its %d pages are released", r.seq_id,
                         len(old.pages))
                self._release(old, ended=True)
            seq = Sequence([], seq_id=r.seq_id)
        else:
            seq = self.sequences.get(r.seq_id)
            if seq is None and r.end and not r.tokens and r.refusal is None:
                # END with nothing to run: the sequence is already gone (its START was refused,
                # or it was reclaimed). Closing it is what the client should do: acknowledged.
                r.reply(Reply(kv_pages=(0, 0)))
                return None
            if seq is None:
                self._refuse(r, INVALID_ARG, "unknown_sequence",
                             f"sequence {r.seq_id} is not held by the model: send its first "
                             f"request with START (it may have ended or been reclaimed)")
                return None
        seq.last_active = self.clock()  # a refused request counts as activity too
        if r.refusal is not None:
            self._refuse(r, INVALID_ARG, *r.refusal)
            return None
        if not r.tokens:
            if r.end and not r.start:
                self._release(seq, ended=True)
                r.reply(Reply(kv_pages=(0, 0)))
                return None
            self._refuse(r, INVALID_ARG, "empty", f"sequence {r.seq_id}: TOKENS is empty")
            return None
        try:
            if seq.swapped is not None:
                engine.check_request(seq, r.tokens)  # before its KV moves back
                self._with_room(seq, len(r.tokens), jobs, lambda: self._swap_in(seq))
            before = (len(seq.token_ids), len(seq.pages), len(seq.ring),
                      seq.state_slot is not None)
            reuse = self._with_room(seq, len(r.tokens), jobs,
                                    lambda: engine.admit(seq, r.tokens, r.cache_salt))
        except RequestError as e:
            self._refuse(r, INVALID_ARG, e.reason, f"sequence {r.seq_id}: {e}")
            return None
        except PagesExhausted as e:
            if not self._wait(r, seq, e):
                self._refuse_exhausted(r, e)
            return None
        if r.start:
            self._admissions += 1
            seq.admitted = self._admissions
            self.sequences[r.seq_id] = seq
            self._started(seq, reuse)
        return Job(r, seq, *before)

    def _started(self, seq: Sequence, reuse: Reuse) -> None:
        self._observe("prefix", reuse.queried, reuse.reused, reuse.continued, reuse.from_host)
        how = ("its previous turn continued" if reuse.continued else "cached blocks")
        if reuse.from_host:
            how += f", {reuse.from_host} of them from the host tier"
        log.info("sequence %s: START of %d tokens, %d reused (%s)", seq.seq_id,
                 len(seq.token_ids), reuse.reused, how if reuse.reused else "none cached")

    def _prefill_groups(self, jobs: list[Job]) -> list[list[Job]]:
        """Prompts of one context bucket run as one call, up to the largest prefill batch. A
        prompt longer than the largest prefill entry runs alone, in chunks."""
        by_bucket: dict[int, list[Job]] = {}
        alone = []
        for job in jobs:
            n = len(job.seq.token_ids) - job.seq.num_cached
            if n > self.engine.max_call_tokens(job.seq):
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

    def _run(self, kind: str, jobs: list[Job]) -> None:
        seqs = [j.seq for j in jobs]
        tokens = sum(len(s.token_ids) - s.num_cached for s in seqs)
        t0 = self.clock()
        executions_before = self.engine.executions
        waits = [t0 - j.request.arrived for j in jobs]
        phases_before = self.engine.phase_seconds()
        t_call = time.perf_counter()
        try:
            if kind == "decode":
                logits = self.engine.decode(seqs)
            elif len(seqs) == 1 and len(seqs[0].token_ids) - seqs[0].num_cached > \
                    self.engine.max_call_tokens(seqs[0]):
                logits = self.engine.prefill_chunked(seqs[0])
            else:
                logits = self.engine.prefill(seqs)
        except Exception as e:
            log.exception("%s call for sequences %s failed", kind, [s.seq_id for s in seqs])
            for j in jobs:
                kept = self.engine.rollback(j.seq, j.num_tokens, j.num_pages, j.num_ring,
                                            j.had_state_slot)
                lost = ""
                if j.request.start or not kept:
                    self._release(j.seq)
                    if not kept:  # its state holds part of this request: it cannot go on
                        lost = "; its linear-attention state cannot be rewound: sequence ended"
                j.request.reply(Reply(error=f"sequence {j.seq.seq_id}: the {kind} call failed: "
                                            f"{type(e).__name__}: {e}{lost}", code=INTERNAL))
            return
        seconds = self.clock() - t0
        t_called = time.perf_counter()
        if sum(self.stats.calls.values()) < LOGGED_CALLS:
            log.info("%s call %s: %d rows (sequences %s), %d tokens, in %.1f ms", kind,
                     self.engine.last_entry, len(jobs), [s.seq_id for s in seqs], tokens,
                     seconds * 1e3)
        self._observe("call", kind, self.engine.last_entry, len(jobs), tokens, waits, seconds,
                      self.engine.executions - executions_before)
        for j, row in zip(jobs, logits):
            pages = (len(j.seq.pages), len(j.seq.ring))
            if j.request.end:
                self._release(j.seq, ended=True)
            j.request.reply(Reply(logits=row, kv_pages=pages))
        t_done = time.perf_counter()
        phases = {k: v - phases_before[k] for k, v in self.engine.phase_seconds().items()}
        admit, self._admit_seconds = self._admit_seconds, 0.0
        self._observe("timing", CallTiming(
            kind, self.engine.last_entry, len(jobs), tokens, wait=max(waits), admit=admit,
            **phases, respond=t_done - t_called,
            other=(t_called - t_call) - sum(phases.values()),
            total=admit + (t_done - t_call)))

    def _release(self, seq: Sequence, ended: bool = False) -> None:
        """The sequence is no longer held for its id. Ended by its client (END): kept whole
        for a next turn while pages allow; otherwise (reclaimed, a failed START) freed. A
        swapped-out sequence's host copy is released."""
        if self.sequences.get(seq.seq_id) is seq:
            del self.sequences[seq.seq_id]
        self._retry_waiting = True
        if seq.swapped is not None:
            self.host.drop(seq)
        if ended:
            self.engine.finish(seq)
        else:
            self.engine.free(seq)

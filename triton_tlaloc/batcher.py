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
  idle live sequences are then swapped out to host memory, busy ones preempted (or, when the
  host tier is full, their KV given up and computed again on their next request: only for an
  admitted sequence's request, never a new START's), and a request that still cannot run
  waits for pages (scheduling/room.py); otherwise the request is refused by name
  (scheduling/admission.py). A refused request still counts as activity. No live sequence's tokens
  are ever lost.
- Calls. Decode rows of several sequences go into one decode call on the smallest entry that
  holds them; prompts of one context bucket into one prefill call (a call computes every row at
  its entry's context, so buckets are not merged); a prompt longer than the largest prefill
  entry runs alone, in chunks. A call that fails is rolled back row by row.
- Entries still compiling (the model is ready before every entry is compiled). A call runs on a
  compiled entry that holds it; when none does, its entry is asked for and the call is held
  back, admitted, while the thread serves every other sequence; it runs in the first round
  after an entry compiles (a prompt in chunks keeps the chunks it ran). The thread never waits
  for a compile.
- Every request gets exactly one reply: its logits, or an error with a code naming the problem.

Pure Python over an `Engine`: no Triton or JAX import here, so it is tested with a fake clock
and a fake runtime (tests/unit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import numpy as np

from .codes import INTERNAL, INVALID_ARG, UNAVAILABLE
from .engine.core import Engine, EntryCompiling, Sequence
from .kv.sequence import SequenceStatus
from .kv.host_tier import HostTier
from .scheduling.observer import BatcherStats, CallTiming, Observer
from .model_parameters import default_int
from .scheduling.admission import Admission, Job, Reply, Request
from .scheduling.batcher_state import BatcherState
from .scheduling.policy import BatchPolicy, Cohort, select
from .scheduling.room import RoomMaker
if TYPE_CHECKING:
    from .lora.registry import AdapterRegistry
from .scheduling.round_plan import (MixedCall, RoundPlan, bucket_calls, decode_calls,
                                    fitted_chunk, forced_rows_to_decode, mixed_calls,
                                    prefill_calls)

# What the front ends take from here: the batcher, its requests and replies, and reply codes.
__all__ = ["Batcher", "INTERNAL", "INVALID_ARG", "Job", "Reply", "Request", "UNAVAILABLE"]

log = logging.getLogger("triton_tlaloc.batcher")


# Calls logged one by one at INFO at the start; later ones only in the counters and metrics.
LOGGED_CALLS = 20


class Batcher:
    def __init__(self, engine: Engine, policy: BatchPolicy = BatchPolicy(),
                 clock: Callable[[], float] = time.monotonic,
                 observers: tuple[Observer, ...] = (), host_tier: HostTier | None = None,
                 preempt_wait_s: float = default_int("preempt_wait_microseconds") / 1e6,
                 adapters: AdapterRegistry | None = None):
        self.engine = engine
        self.policy = policy
        self.clock = clock
        # The host tier (None: off). With it, a request short of pages swaps idle sequences
        # out, preempts, or waits up to preempt_wait_s, instead of being refused.
        self.host = host_tier
        self.preempt_wait_s = preempt_wait_s
        self.stats = BatcherStats()
        self._observers = [self.stats, *observers]
        # What admission and room making share with this thread: held sequences, waiting
        # requests, busy ids, jobs held back for a compile.
        self.state = BatcherState(engine, host_tier, clock, self._observe, adapters)
        self.sequences = self.state.sequences  # held sequences by id (the same dict)
        self.room = RoomMaker(self.state, policy, preempt_wait_s)
        self.admission = Admission(self.state, self.room)
        self._entries_changed = False  # an entry compiled since calls were held back
        self._admit_seconds = 0.0  # admission of the current round's requests
        self._pending: deque[Request] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._groups = 0
        self.cohort = Cohort(set())  # the previous decode batch's sequences (scheduling/policy.py)
        self._decode_s: float | None = None  # the last round's decode calls took (the clock)
        self._evicted = (0, 0)  # cached pages evicted, ended sequences dropped, so far
        # Called after every round (on this thread): local generations send the round's tokens.
        self.round_listeners: list[Callable[[], None]] = []
        # Of every entry, compiled or compiling (the engine splits a call while its entry
        # compiles).
        entries = engine.art.entries.values()
        self.max_decode_batch = max((e.batch for e in entries if e.kind == "decode"), default=1)
        self.max_prefill_batch = max((e.batch for e in entries if e.kind == "prefill"), default=1)
        self.max_verify_batch = max((e.batch for e in entries if e.kind == "verify"), default=1)
        self.max_mixed_batch = max((e.batch for e in entries if e.kind == "mixed"), default=0)
        self.context_ladder = sorted(engine.art.context_ladder)
        engine.waits_for_compiles = False  # this thread holds such a call back instead

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

    def entries_compiled(self) -> None:
        """An entry finished compiling (the runtime's compile threads call this): calls held
        back for one run again in the next round."""
        with self._cv:
            self._entries_changed = True
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
            leftover = list(self._pending) + [j.request for j in self.state.held_back
                                              + self.state.under_way]
            self._pending.clear()
            self.state.held_back, self.state.under_way = [], []
        for r in leftover:
            r.reply(Reply(error="the model is unloading", code=UNAVAILABLE))
        self._round_ended()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stopping:
                        return
                    now = self.clock()
                    taken, resumed, wake_at = self._select(now)
                    sweep_at = self.room.sweep_at()
                    if taken or resumed or (sweep_at is not None and now >= sweep_at):
                        break
                    wake_at = min((t for t in (wake_at, sweep_at) if t is not None),
                                  default=None)
                    self._cv.wait(None if wake_at is None else max(0.0, wake_at - now))
            try:
                self.room.sweep(now)
                if taken or resumed:
                    self.process(taken, resumed)
            except Exception:  # never leave a request unanswered, never let the thread die
                log.exception("batcher round failed")
                held = {id(j.request) for j in self.state.held_back + self.state.under_way}
                for r in taken + [j.request for j in resumed]:
                    if not r._answered and id(r) not in held:
                        r.reply(Reply(error="internal error in the batcher (see the server "
                                            "log)", code=INTERNAL))
            self._round_ended()

    def _round_ended(self) -> None:
        for listener in self.round_listeners:
            try:
                listener()
            except Exception:  # never let the thread die
                log.exception("a round listener failed")

    def run_pending(self) -> bool:
        """One round on the caller's thread if one is due now (tests drive the clock)."""
        now = self.clock()
        with self._cv:
            taken, resumed, _ = self._select(now)
        self.room.sweep(now)
        if taken or resumed:
            self.process(taken, resumed)
            self._round_ended()
        return bool(taken or resumed)

    # ------------------------------------------------------------ what runs when

    def _select(self, now: float) -> tuple[list[Request], list[Job], float | None]:
        """Take the requests `policy.select` runs now off the queue (called with the lock
        held); returns them, the held-back jobs that may run now (an entry compiled since they
        were held back), and when to look again if some wait."""
        resumed = []
        if self.state.held_back and self._entries_changed:
            resumed, self.state.held_back = self.state.held_back, []
            for j in resumed:
                j.seq.move_to(SequenceStatus.RUNNING)
        self._entries_changed = False
        # A sequence whose request waits (for pages, or an entry) sends no other.
        waiting = {r.seq_id for r in self.state.waiting} | self.state.in_flight_ids()
        # A swapped-out or dropped sequence is not waited for by its cohort, nor one whose
        # prompt is under way (its next request comes after its prompt's reply).
        off = ({s.seq_id for s in self.room.off_device()}
               | {j.seq.seq_id for j in self.state.under_way})
        held = {k for k in self.sequences if k not in off} if off else self.sequences
        taken, wake_at = select([r for r in self._pending if r.seq_id not in waiting], now=now,
                                policy=self.policy, cohort=self.cohort, held=held,
                                max_prefill_batch=self.max_prefill_batch,
                                chunk_seconds=self._chunk_seconds)
        if (taken and self.max_mixed_batch and all(r.is_prompt for r in taken)
                and self._cohort_expected(now)):
            # Prompts alone while streams are between steps: they wait for the streams'
            # next step (its cohort's deadline at most), to ride it instead of stalling it.
            wake_at = (self.cohort.deadline if wake_at is None
                       else min(wake_at, self.cohort.deadline))
            taken = []
        if taken:
            ids = {id(r) for r in taken}
            self._pending = deque(r for r in self._pending if id(r) not in ids)
        if self.state.under_way:
            # A prompt under way goes on in the next step, which waits for its cohort's decode
            # rows as any step does: riding with them is what keeps it from stalling them.
            if taken or resumed or not self._cohort_expected(now):
                resumed = resumed + self.state.under_way
                self.state.under_way = []
            else:
                wake_at = (self.cohort.deadline if wake_at is None
                           else min(wake_at, self.cohort.deadline))
        if self.state.waiting:
            # Waiting requests try again first (before newer ones take the pages) in every
            # round, and alone when pages were released since they last tried or at their
            # deadline.
            due = min(r.waiting_since for r in self.state.waiting) + self.preempt_wait_s
            if taken or self.state.retry_waiting or now >= due:
                taken = self.state.waiting + taken
                self.state.waiting, self.state.retry_waiting = [], False
            else:
                wake_at = due if wake_at is None else min(wake_at, due)
        return taken, resumed, wake_at

    def _cohort_expected(self, now: float) -> bool:
        """Whether the decode cohort still waits for a member's next request."""
        if now >= self.cohort.deadline:
            return False
        queued = {r.seq_id for r in self._pending}
        under_way = {j.seq.seq_id for j in self.state.under_way}
        return any(s in self.sequences and s not in queued and s not in under_way
                   for s in self.cohort.members)

    # ------------------------------------------------------------ one round

    def process(self, requests: list[Request], resumed: list[Job] = ()) -> None:
        """One round: admit `requests`, then run them with the `resumed` jobs (admitted in
        an earlier round and held back until an entry compiled)."""
        self.execute(self.schedule(requests, resumed))

    def schedule(self, requests: list[Request], resumed: list[Job] = ()) -> RoundPlan:
        """Admit `requests` (reserving their pages, making room) and group the jobs with the
        `resumed` ones into calls: the round's plan, nothing run yet."""
        if self.host is not None:  # who may not be swapped out as idle (scheduling/room.py)
            with self._cv:
                queued = {r.seq_id for r in self._pending}
            self.state.busy = ({r.seq_id for r in requests} | {j.seq.seq_id for j in resumed}
                               | queued | {r.seq_id for r in self.state.waiting}
                               | self.state.in_flight_ids())
        self.state.moves = []
        jobs: list[Job] = list(resumed)  # a preempted sequence's job leaves the list
        t0 = time.perf_counter()
        for r in forced_rows_to_decode(requests, self._call_seconds):
            # Its forced tokens go unchecked: answered as a verify call keeping none (its
            # generation feeds them in later steps).
            r.tokens, r.draft_tokens, r.drafts_unchecked = r.tokens[:-r.draft_tokens], 0, True
        for r in requests:
            try:
                job = self.admission.admit(r, jobs)
            except Exception:  # one request's fault must not fail the round's others
                log.exception("sequence %s: admitting a request failed", r.seq_id)
                self.state.waiting = [w for w in self.state.waiting if w is not r]
                if not r._answered:
                    r.reply(Reply(error=f"sequence {r.seq_id}: internal error admitting the "
                                        f"request (see the server log)", code=INTERNAL))
                continue
            if job is not None:
                jobs.append(job)
        plan = RoundPlan(moves=self.state.moves)
        decode = []
        for j in (j for j in jobs if j.is_decode):
            compiling = self.engine.decode_waits_for(j.seq)
            if compiling is not None:
                plan.held_back.append((j, compiling))
            else:
                decode.append(j)
        prompts = [j for j in jobs if not j.is_decode and not j.request.is_verify]
        chunk = self.policy.chunk_tokens(self.engine.max_mixed_tokens)
        if prompts:  # (the first prompt is the one mixed_calls gives the step)
            first = prompts[0].seq
            chunk = self.engine.within_ring(first, fitted_chunk(
                len(first.uncached), chunk, self.engine.mixed_chunk_sizes))
        plan.mixed, decode, plan.deferred = mixed_calls(decode, prompts, self.max_mixed_batch,
                                                        chunk)
        if plan.mixed:
            prompts = []  # one rides the step, the others wait for the next
        plan.decode = decode_calls(decode, self.max_decode_batch)
        plan.verify = bucket_calls([j for j in jobs if j.request.is_verify],
                                   self.max_verify_batch, self.context_ladder)
        plan.prefill = prefill_calls(prompts, self.max_prefill_batch, self.context_ladder,
                                     self.engine.max_call_tokens)
        plan.admit_seconds = time.perf_counter() - t0
        return plan

    def _call_seconds(self, kind: str, rows: int, tokens: int) -> float | None:
        return self.stats.call_seconds(self.engine.art.entries, kind, rows, tokens)

    def _chunk_seconds(self, r: Request) -> float | None:
        """A scoring chunk's recent time: a verify call of its tokens (policy.select)."""
        return self._call_seconds("verify", 1, len(r.tokens))

    def execute(self, plan: RoundPlan) -> None:
        """Run a round's plan: its calls in order, each row answered; then the decode cohort
        and the pools' gauges."""
        for job, entry in plan.held_back:
            self._hold_back([job], "decode", entry)
        self._admit_seconds = plan.admit_seconds  # charged to the round's first call
        self.state.under_way += plan.deferred
        if plan.decode or plan.mixed:
            t_decode = self.clock()
            for call in plan.mixed:
                self._run_mixed(call)
            for call in plan.decode:
                self._run("decode", call)
            self._decode_s = self.clock() - t_decode
            rows = [j for call in plan.decode for j in call] + [j for m in plan.mixed
                                                                  for j in m.decode]
            self.cohort = Cohort({j.seq.seq_id for j in rows if not j.request.end},
                                 self.clock() + self.policy.cohort_wait(self._decode_s))
        for call in plan.verify:
            self._run("verify", call)
        for call in plan.prefill:
            self._run("prefill", call)
        if plan.prefill or plan.verify or plan.mixed:
            # A sequence whose prompt (or verify call) just ran decodes next: it joins the
            # cohort, so prompts sent together decode together from their first step.
            ran = [j for call in plan.prefill + plan.verify + [[m.chunk] for m in plan.mixed]
                   for j in call if not j.seq.uncached]
            self.cohort = Cohort(self.cohort.members | {j.seq.seq_id for j in ran
                                                        if j.seq.seq_id in self.sequences},
                                 self.clock() + self.policy.cohort_wait(self._decode_s))
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

    def _run(self, kind: str, jobs: list[Job]) -> None:
        seqs = [j.seq for j in jobs]
        tokens = sum(len(s.token_ids) - s.num_cached for s in seqs)
        t0 = self.clock()
        executions_before = self.engine.executions
        waits = [t0 - j.request.arrived for j in jobs if not j.started]
        phases_before = self.engine.phase_seconds()
        t_call = time.perf_counter()
        try:
            if kind == "decode":
                logits = self.engine.decode(seqs)
            elif kind == "verify":
                logits = self.engine.verifier.verify(seqs, [j.request.draft_tokens for j in jobs],
                                            any(j.request.want_logits for j in jobs),
                                            [j.request.acceptor for j in jobs])
            elif len(seqs) == 1 and len(seqs[0].token_ids) - seqs[0].num_cached > \
                    self.engine.max_call_tokens(seqs[0]):
                if self.engine.max_mixed_tokens:  # a chunk a round: other steps between
                    logits = self.engine.prefill_chunk(seqs[0],
                                                       self.engine.max_call_tokens(seqs[0]))
                else:
                    logits = self.engine.prefill_chunked(seqs[0])
            else:
                logits = self.engine.prefill(seqs)
        except EntryCompiling as e:
            self._hold_back(jobs, kind, e.entry_name)
            return
        except Exception as e:
            self._failed(kind, jobs, e)
            return
        seconds = self.clock() - t0
        t_called = time.perf_counter()
        if sum(self.stats.calls.values()) < LOGGED_CALLS:
            log.info("%s call %s: %d rows (sequences %s), %d tokens, in %.1f ms", kind,
                     self.engine.last_entry, len(jobs), [s.seq_id for s in seqs], tokens,
                     seconds * 1e3)
        self._observe("call", kind, self.engine.last_entry, len(jobs), tokens, waits, seconds,
                      self.engine.executions - executions_before)
        if kind == "prefill":
            self._step(jobs, tokens, 0, t0)
        else:
            self._step([], 0, tokens, t0)
        if kind == "verify":
            # A grammar's forced tokens are not drafts: a row of them alone is no speculation.
            speculating = [(j.request.draft_tokens - j.request.forced_tokens,
                            len(v.accepted) - 1 - j.request.forced_tokens)
                           for j, v in zip(jobs, logits)
                           if j.request.draft_tokens > j.request.forced_tokens]
            if speculating:
                self._observe("speculation", sum(d for d, _ in speculating),
                              sum(a for _, a in speculating), len(speculating))
        self._answer(kind, jobs, logits)
        t_done = time.perf_counter()
        phases = {k: v - phases_before[k] for k, v in self.engine.phase_seconds().items()}
        admit, self._admit_seconds = self._admit_seconds, 0.0
        self._observe("timing", CallTiming(
            kind, self.engine.last_entry, len(jobs), tokens, wait=max(waits, default=0.0), admit=admit,
            **phases, respond=t_done - t_called,
            other=(t_called - t_call) - sum(phases.values()),
            total=admit + (t_done - t_call)))

    def _answer(self, kind: str, jobs: list[Job], logits) -> None:
        """Each job's reply from its row of a call's logits; a prompt with tokens still to
        compute (a chunk ran) is under way: it goes on in the next round, unanswered."""
        broken = self._nonfinite_rows(kind, jobs, logits)
        for j, row, bad in zip(jobs, logits, broken):
            if j.seq.uncached and not bad:
                self.state.under_way.append(j)
                continue
            pages = (len(j.seq.pages), len(j.seq.ring))
            if j.request.end:
                self.state.release(j.seq, ended=True)
            if bad:
                j.request.reply(Reply(error=f"sequence {j.seq.seq_id}: the model's logits hold "
                                            f"NaN or infinity (its weights or its KV are not "
                                            f"finite)", code=INTERNAL))
                continue
            if kind == "verify":
                j.request.reply(Reply(logits=row.logits, accepted_ids=row.accepted,
                                      kv_pages=pages))
            elif j.request.drafts_unchecked:
                j.request.reply(self._as_verified(j.request, row, pages))
            else:
                j.request.reply(Reply(logits=row, kv_pages=pages))

    def _step(self, prompts: list[Job], prompt_tokens: int, decode_tokens: int,
              t0: float) -> None:
        """Report a call's tokens by part, and the wait of each prompt whose first tokens it
        ran (started at `t0`)."""
        self._observe("step", prompt_tokens, decode_tokens)
        for j in prompts:
            if not j.started:
                j.started = True
                self._observe("prompt_started", t0 - j.request.arrived)

    def _failed(self, kind: str, jobs: list[Job], e: Exception) -> None:
        """A call failed: each of its jobs rolled back and answered with the error."""
        log.exception("%s call for sequences %s failed", kind, [j.seq.seq_id for j in jobs])
        for j in jobs:
            kept = self.state.roll_back(j)
            lost = ""
            if j.request.start or not kept:
                self.state.release(j.seq)
                if not kept:  # its state holds part of this request: it cannot go on
                    lost = "; its linear-attention state cannot be rewound: sequence ended"
            j.request.reply(Reply(error=f"sequence {j.seq.seq_id}: the {kind} call failed: "
                                        f"{type(e).__name__}: {e}{lost}", code=INTERNAL))

    def _run_mixed(self, call: MixedCall) -> None:
        """A mixed call: its decode rows answered, its chunk's prompt answered once its last
        token ran (or under way). With no compiled mixed entry for it, the two calls apart."""
        jobs = [*call.decode, call.chunk]
        seqs = [j.seq for j in call.decode]
        t0 = self.clock()
        waits = [t0 - j.request.arrived for j in jobs if not j.started]
        phases_before = self.engine.phase_seconds()
        t_call = time.perf_counter()
        try:
            logits = self.engine.mixed(seqs, call.chunk.seq, call.tokens)
        except Exception as e:
            self._failed("mixed", jobs, e)
            return
        if logits is None:
            self._run("decode", call.decode)
            self._run("prefill", [call.chunk])
            return
        seconds = self.clock() - t0
        t_called = time.perf_counter()
        tokens = len(seqs) + call.tokens
        if sum(self.stats.calls.values()) < LOGGED_CALLS:
            log.info("mixed call %s: %d decode rows (sequences %s) and %d tokens of sequence "
                     "%s's prompt, in %.1f ms", self.engine.last_entry, len(seqs),
                     [s.seq_id for s in seqs], call.tokens, call.chunk.seq.seq_id,
                     seconds * 1e3)
        self._observe("call", "mixed", self.engine.last_entry, len(jobs), tokens, waits,
                      seconds, 1)
        self._step([call.chunk], call.tokens, len(seqs), t0)
        self._answer("decode", call.decode, logits[:-1])
        self._answer("prefill", [call.chunk], logits[-1:])
        t_done = time.perf_counter()
        phases = {k: v - phases_before[k] for k, v in self.engine.phase_seconds().items()}
        admit, self._admit_seconds = self._admit_seconds, 0.0
        self._observe("timing", CallTiming(
            "mixed", self.engine.last_entry, len(jobs), tokens, wait=max(waits, default=0.0), admit=admit,
            **phases, respond=t_done - t_called,
            other=(t_called - t_call) - sum(phases.values()),
            total=admit + (t_done - t_call)))

    def _nonfinite_rows(self, kind: str, jobs: list[Job], logits) -> list[bool]:
        """Which rows' logits hold NaN or infinity: those are answered with an error (a
        sampler or an argmax would turn them into a token silently), counted and logged."""
        rows = [row.logits for row in logits] if kind == "verify" else list(logits)
        bad = [row is not None and not np.isfinite(row).all() for row in rows]
        if any(bad):
            self._observe("nonfinite", kind, sum(bad))
            if self.stats.nonfinite_rows[kind] <= LOGGED_CALLS:
                log.warning("%s call %s: logits of sequences %s hold NaN or infinity",
                            kind, self.engine.last_entry,
                            [j.seq.seq_id for j, b in zip(jobs, bad) if b])
        return bad

    @staticmethod
    def _as_verified(r: Request, row: np.ndarray, pages: tuple[int, int]) -> Reply:
        """A verify request whose drafts went unchecked, answered as accepting none: the
        model's own next token (its acceptor's choice when sampling)."""
        token = int(np.argmax(row)) if r.acceptor is None else r.acceptor(row[None], [])[1]
        return Reply(logits=row if r.want_logits else None, accepted_ids=[token],
                     kv_pages=pages)

    def held_back_ids(self) -> set:
        """The sequences whose request is held back until an entry compiles."""
        return self.state.held_back_ids()

    def _hold_back(self, jobs: list[Job], kind: str, entry_name: str) -> None:
        """Hold admitted jobs back until an entry compiles: their sequences keep what they
        hold (and what chunks of a prompt ran) and are neither swapped out nor reclaimed."""
        for j in jobs:
            log.info("sequence %s: its %s call waits for entry %s, still compiling; other "
                     "sequences are served meanwhile", j.seq.seq_id, kind,
                     entry_name)
            self._observe("held_back", kind)
            j.seq.move_to(SequenceStatus.HELD_FOR_COMPILE)
        with self._cv:
            self.state.held_back += jobs

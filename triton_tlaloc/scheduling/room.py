"""Making room for a request short of pages: reclamation of sequences Triton has ended, and
with the host tier swapping, preemption, dropping of KV to compute again (when the host tier is
full) and waiting (docs/design.md#the-host-tier).

`RoomMaker` decides whose pages go when a request needs more than are free; the batcher owns
one, and so does its admission, over the state they share (batcher_state.BatcherState). Pure
Python: no Triton or JAX.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..codes import UNAVAILABLE
from ..engine.core import Sequence
from ..pages import FULL, PagesExhausted
from .policy import BatchPolicy, choose_reclaim, choose_swap_out

if TYPE_CHECKING:
    from .admission import Job, Request
    from .batcher_state import BatcherState

log = logging.getLogger("triton_tlaloc.batcher")


class RoomMaker:
    """Reclamation, swapping out, preemption, dropping and waiting, over the batcher's state."""

    def __init__(self, state: BatcherState, policy: BatchPolicy, preempt_wait_s: float):
        self.state = state
        self.engine = state.engine
        self.host = state.host
        self.clock = state.clock
        self.sequences = state.sequences  # the same dict: held sequences by id
        self.policy = policy
        # With the host tier, how long a request short of pages waits before it is refused
        self.preempt_wait_s = preempt_wait_s

    def _reclaim_for(self, seq: Sequence, n_tokens: int) -> bool:
        """Free pages held by sequences Triton has ended, as many as `seq` needs to take
        `n_tokens` more (in every pool); False (and nothing reclaimed) when they cannot."""
        now = self.clock()
        in_flight = self.state.in_flight_ids()  # their requests are in flight
        candidates = [(s.seq_id, s.holding, s.last_active)
                      for s in self.sequences.values()
                      if s is not seq and s.seq_id not in in_flight]
        victims = choose_reclaim(candidates, self._lacking(seq, n_tokens), now,
                                 self.policy.reclaim_after_s)
        if not victims:
            return False
        pages = 0
        for seq_id in victims:
            victim = self.sequences[seq_id]
            log.info("reclaimed sequence %s: %d pages%s%s, idle %.1f s (Triton ends a sequence "
                     "idle %.1f s)", seq_id, len(victim.pages),
                     f" and {len(victim.ring)} ring pages" if victim.ring else "",
                     f", state slot {victim.state_slot}" if victim.state_slot is not None else "",
                     now - victim.last_active, self.policy.idle_timeout_s)
            pages += len(victim.pages) + len(victim.ring)
            self.state.release(victim)
        self.state.observe("reclaimed", len(victims), pages)
        return True

    def _lacking(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """Per pool, what `seq` needs to take `n_tokens` more beyond what is free, cached or
        only kept for a next turn (all of which a reservation takes first)."""
        available = self.engine.blocks.available()
        return {k: n - available[k] for k, n in self.engine.pages_needed(seq, n_tokens).items()
                if n > available[k]}

    def _on_device(self, seq: Sequence) -> list[Sequence]:
        """The other held sequences whose KV is on the device (candidates to swap out), but
        for those whose call is held back until an entry compiles or whose prompt is under way
        (it runs as admitted)."""
        in_flight = self.state.in_flight_ids()
        return [s for s in self.sequences.values()
                if s is not seq and s.swapped is None and any(s.holding.values())
                and s.seq_id not in in_flight]

    def with_room(self, seq: Sequence, n_tokens: int, jobs: list[Job], attempt):
        """`attempt()`, making room when it runs short of pages: sequences Triton has ended
        are reclaimed; with the host tier, idle sequences are swapped out and, when they are
        not enough, the round's most recently admitted sequences preempted, one at a time,
        never the requester's betters for nothing. When the host tier cannot take them, an
        admitted sequence's request drops the same victims' KV instead (computed again on
        their next request): what STARTed is served before a new START is. Raises the last
        PagesExhausted."""
        try:
            return attempt()
        except PagesExhausted as e:
            last = e
        if self._reclaim_for(seq, n_tokens):
            try:
                return attempt()
            except PagesExhausted as e:
                last = e
        if self.host is None:
            raise last
        while self._make_room_for(seq, n_tokens, jobs, drop=False):
            try:
                return attempt()
            except PagesExhausted as e:
                last = e
        while self.state.admitted(seq) and self._make_room_for(seq, n_tokens, jobs, drop=True):
            try:
                return attempt()
            except PagesExhausted as e:
                last = e
        raise last

    def _make_room_for(self, seq: Sequence, n_tokens: int, jobs: list[Job], drop: bool) -> bool:
        """Swap out (or preempt) the next sequence that helps `seq` take `n_tokens` more, or
        with `drop` give up its KV; False when none can cover what it lacks (nothing is
        touched then)."""
        short = self._lacking(seq, n_tokens)
        if not short:
            return False
        refs = self.engine.blocks.full.refs
        held = [s for s in self._on_device(seq) if drop or self.host.fits(s)]
        idle = sorted((s for s in held if s.seq_id not in self.state.busy),
                      key=lambda s: s.last_active)
        # The requester ranks as it was admitted (a new START: after every other).
        rank = seq.admitted if self.state.admitted(seq) else self.state.admissions + 1
        busy = sorted((s for s in held if s.seq_id in self.state.busy and s.admitted > rank),
                      key=lambda s: -s.admitted)
        # A page another sequence holds too is not freed by moving this one.
        victim = choose_swap_out(
            [(s, {**s.holding, FULL: sum(refs[p] == 1 for p in s.pages)}) for s in idle + busy],
            short)
        if victim is None:
            return False
        job = next((j for j in jobs if j.seq is victim), None)
        if victim.seq_id in self.state.busy:
            self._preempt(victim, job, jobs, drop)
        elif drop:
            self._drop(victim, f"idle {self.clock() - victim.last_active:.1f} s")
        else:
            self._swap_out(victim, f"idle {self.clock() - victim.last_active:.1f} s")
        return True

    def _preempt(self, victim: Sequence, job: Job | None, jobs: list[Job],
                 drop: bool = False) -> None:
        """Swap out (or with `drop`, drop) a sequence whose request is in this round (or
        queued): its request waits for pages (a job already admitted is rolled back first)."""
        self._preempted(victim)
        if job is not None:
            jobs.remove(job)
            if job.request.start:  # nothing of it is computed: it starts again when it can
                self.state.release(victim)
                if self.defer(job.request):
                    log.info("sequence %s preempted before its prompt ran: it waits for "
                             "pages", victim.seq_id)
                return
            self.state.roll_back(job)
            self.defer(job.request)
        if drop:
            self._drop(victim, "preempted")
        elif victim.swapped is None and not victim.dropped:  # a rolled-back readmission holds none
            self._swap_out(victim, "preempted")

    def wait(self, r: Request, seq: Sequence, e: PagesExhausted) -> bool:
        """With the host tier, a request short of pages waits for them (its sequence swapped
        out, or dropped when the host tier cannot take it) until its deadline; False: it is
        refused now (no host tier, past the deadline, more than the pools hold, or a new START
        while the host tier is full: new users are turned away before admitted ones)."""
        if self.host is None:
            return False
        now = self.clock()
        if r.waiting_since is not None and now - r.waiting_since >= self.preempt_wait_s:
            e.args = (f"{e}; waited {now - r.waiting_since:.1f} s for pages "
                      f"(preempt_wait_microseconds {self.preempt_wait_s * 1e6:.0f})",)
            return False
        capacity = {name: pool.capacity for name, pool in self.engine.pools().items()}
        total = self.engine.blocks.need(Sequence([]), len(seq.token_ids) + len(r.tokens))
        if any(n > capacity[k] for k, n in total.items()):
            return False  # it would never fit
        if not self.state.admitted(seq):  # a START's admission was undone: it holds nothing
            unfit = [s for s in self._on_device(seq)
                     if s.seq_id not in self.state.busy and not self.host.fits(s)]
            if unfit:
                e.args = (f"{e}; the host tier is full ({self.host.used} of "
                          f"{self.host.budget} bytes)",)
                return False
        elif any(seq.holding.values()):
            self._preempted(seq)
            if self.host.fits(seq):
                self._swap_out(seq, "preempted")
            else:
                self._drop(seq, "preempted; the host tier is full")
        self.defer(r)
        return True

    def _preempted(self, seq: Sequence) -> None:
        """A sequence with a request in the round or waiting gives up its place on the device."""
        self.state.observe("preempted")
        self.state.moves.append(("preempted", seq.seq_id))

    def defer(self, r: Request, what: str = "KV pages") -> bool:
        """`r` waits for `what`, up to preempt_wait_s from the first time it waited. A request
        put back to wait when that has run out (admitted meanwhile, then preempted again
        before its call ran) is refused now instead, naming how long it waited: False."""
        now = self.clock()
        if r.waiting_since is None:
            r.waiting_since = now
            log.info("sequence %s waits for %s (up to %.1f s)", r.seq_id, what,
                     self.preempt_wait_s)
        elif now - r.waiting_since >= self.preempt_wait_s:
            from .admission import Reply  # (admission imports this module)

            message = (f"sequence {r.seq_id}: waited {now - r.waiting_since:.1f} s for {what} "
                       f"(preempt_wait_microseconds {self.preempt_wait_s * 1e6:.0f}), "
                       f"preempted again before its call ran (retry later)")
            self.state.observe("refusal", "pages")
            log.info("sequence %s refused (pages): %s", r.seq_id, message)
            r.reply(Reply(error=message, code=UNAVAILABLE))
            return False
        self.state.waiting.append(r)
        self.state.busy.add(r.seq_id)
        return True

    def _drop(self, seq: Sequence, why: str) -> None:
        log.info("sequence %s dropped: %d pages%s given up (%s; the host tier is full): its "
                 "next request computes its %d tokens again", seq.seq_id, len(seq.pages),
                 f" and {len(seq.ring)} ring pages" if seq.ring else "", why,
                 len(seq.token_ids))
        self.engine.drop(seq)
        self.state.moves.append(("dropped", seq.seq_id))
        self.state.observe("recomputed")

    def _swap_out(self, seq: Sequence, why: str) -> None:
        swap = self.host.swap_out(seq)
        self.state.moves.append(("swapped out", seq.seq_id))
        self._swapped(seq, swap, why)

    def swap_in(self, seq: Sequence) -> None:
        swap = self.host.swap_in(seq)
        self.state.moves.append(("swapped in", seq.seq_id))
        self._swapped(seq, swap, f"{swap.shared} pages still cached on the device"
                      if swap.shared else "")

    def _swapped(self, seq: Sequence, swap, why: str) -> None:
        log.info("sequence %s swapped %s: %d pages, %.1f KiB in %.1f ms%s", seq.seq_id,
                 swap.direction, swap.pages, swap.nbytes / 1024, swap.seconds * 1e3,
                 f" ({why})" if why else "")
        self.state.observe("swapped", swap.direction, swap.nbytes, swap.seconds)

    def off_device(self) -> list[Sequence]:
        """Held sequences whose KV is swapped out or dropped (none without the host tier)."""
        if self.host is None:  # nothing is swapped out or dropped
            return []
        return [s for s in self.sequences.values() if s.swapped is not None or s.dropped]

    def sweep_at(self) -> float | None:
        """When the next swapped-out or dropped sequence passes the reclamation rule (its host
        memory and its tokens are then released without waiting for a request to need it)."""
        parked = self.off_device()
        if not parked:
            return None
        return min(s.last_active for s in parked) + self.policy.reclaim_after_s

    def sweep(self, now: float) -> None:
        gone = [s for s in self.off_device() if now - s.last_active > self.policy.reclaim_after_s]
        if not gone:
            return
        for s in gone:
            where = (f"swapped out, {s.swapped.nbytes / 1024:.1f} KiB on the host"
                     if s.swapped is not None else "dropped")
            log.info("reclaimed sequence %s: %s, idle %.1f s (Triton ends a sequence idle "
                     "%.1f s)", s.seq_id, where, now - s.last_active, self.policy.idle_timeout_s)
            self.state.release(s)
            self.state.observe("reclaimed", 1, 0)
        self.state.observe("state", self.engine.blocks.usage(), len(self.sequences))
        self.state.observe("host", self.host.used, self.host.sequences, self.host.cached_bytes)

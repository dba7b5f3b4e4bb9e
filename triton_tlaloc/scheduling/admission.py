"""Admission: what the batcher's requests are and how each is admitted or refused
(docs/design.md#batching).

`Request` is one request as execute() queued it, `Reply` what goes back, `Job` a request
admitted in a round with its sequence as it was before (for rollback). `Admission` admits a
request: a START begins a sequence (taking what prefix reuse finds cached), a later request
appends to its sequence; pages are reserved (its room maker, scheduling/room.py, makes room when
they run short) or the request is refused by name and nothing changes. A sequence whose KV was
dropped to make room is admitted again whole (Engine.readmit). The batcher owns one, over the state
they share (batcher_state.BatcherState). Pure Python: no Triton or JAX.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..codes import INVALID_ARG, UNAVAILABLE
from ..engine.core import RequestError, Sequence
from ..lora.peft_adapter import AdapterError
from ..lora.registry import AdapterSlotsBusy
from ..pages import WINDOWED, PagesExhausted, Reuse

if TYPE_CHECKING:
    from .batcher_state import BatcherState
    from .room import RoomMaker

log = logging.getLogger("triton_tlaloc.batcher")


@dataclass
class Reply:
    logits: np.ndarray | None = None  # [vocab] f32
    kv_pages: tuple[int, int] | None = None  # pages held in the full and the windowed pool
    error: str | None = None
    code: str | None = None  # INVALID_ARG | UNAVAILABLE | INTERNAL when error is set
    # A verify call's: the drafts accepted, then the model's own next token (logits, when
    # asked for, are those after the last accepted position)
    accepted_ids: list[int] | None = None


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
    lora: str | None = None  # a START's LoRA adapter by name, for the sequence's life
    # An adapter load or unload while serving (lora_admin: lora/registry.update), answered by
    # itself: no sequence, no call
    admin: dict | None = None
    waiting_since: float | None = None  # when it first waited for pages (host tier on)
    # Speculation: how many of `tokens` (the last ones) are drafts to verify in one call
    draft_tokens: int = 0
    want_logits: bool = True  # a verify call copies logits out only when some row wants them
    # Sampled speculation (a generation in this process): which drafts stand (engine/speculation.py)
    acceptor: Callable[[np.ndarray, list[int]], tuple[int, int]] | None = None
    # Of the drafts, the first forced_tokens are a grammar's forced tokens (fast-forward): they
    # always stand, and are not counted as speculation's drafts
    forced_tokens: int = 0
    # A draft model's step: the sequence is first cut back to its first keep_tokens tokens
    # (the drafts its target rejected dropped; Verifier.rewind)
    keep_tokens: int | None = None
    # Its drafts were not checked: its sequence's KV had been dropped, and the call that
    # computes it again checks none (answered as a verify call accepting no draft).
    drafts_unchecked: bool = False
    # A chunk of a prompt whose log-probabilities are asked for (generation/logprobs.py
    # PromptScoring), fed as a verify call's forced tokens: it takes its share of the
    # batcher's time (policy.select) and never joins a decode call one token a round
    scoring: bool = False
    _answered: bool = field(default=False, repr=False)

    @property
    def is_decode(self) -> bool:
        """One token for a held sequence: a decode step (everything else runs as a prompt)."""
        return not self.start and len(self.tokens) == 1

    @property
    def is_prompt(self) -> bool:
        """A START or a prefill continuation. A verify request is a step of a decoding
        sequence: it goes with its cohort, not with prompts."""
        return self.start or (len(self.tokens) > 1 and not self.draft_tokens)

    @property
    def is_verify(self) -> bool:
        return self.draft_tokens > 0

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
    was_dropped: bool = False  # its sequence's KV had been dropped: it computes it again
    started: bool = False  # a call ran some of its tokens (a prompt under way)

    @property
    def is_decode(self) -> bool:
        """A decode step: one token for a sequence that has every earlier one computed (one
        cut back into a registered block computes that block's kept positions again: a
        prefill call), or a prompt found cached but for its last token (a decode row too)."""
        if len(self.seq.uncached) != 1:
            return False
        return self.request.is_decode or (self.request.start and self.seq.num_cached > 0)


class Admission:
    """Admission and refusals of the batcher's requests."""

    def __init__(self, state: BatcherState, room: RoomMaker):
        self.state = state
        self.room = room
        self.engine = state.engine
        self.clock = state.clock
        self.sequences = state.sequences  # the same dict: held sequences by id

    def _holding(self, s: Sequence) -> str:
        ring = f", {len(s.ring)} ring pages" if WINDOWED in self.engine.blocks.kinds else ""
        slot = (f", state slot {s.state_slot}" if s.state_slot is not None else "")
        return f"{s.seq_id} ({len(s.pages)} pages{ring}{slot})"

    def _refuse(self, r: Request, code: str, reason: str, message: str) -> None:
        self.state.observe("refusal", reason)
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

    def admit(self, r: Request, jobs: list[Job]) -> Job | None:
        """`r` admitted in this round: its job, to run with `jobs`; or None, answered now (a
        refusal, an END with nothing to run) or put to wait for pages."""
        engine = self.engine
        if r.admin is not None:
            self._update_adapters(r)
            return None
        if r.start:
            old = self.sequences.get(r.seq_id)
            if old is not None:
                # A new START on a held id begins a new sequence: the old KV must never be
                # continued by this id, whether or not this START is admitted. (Ended whole,
                # another prompt of the same history may still take it over.)
                log.info("sequence %s: START on a held id; its %d pages are released", r.seq_id,
                         len(old.pages))
                self.state.release(old, ended=True)
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
        if not r.start and r.lora is not None and r.lora != seq.adapter_name:
            self._refuse(r, INVALID_ARG, "adapter",
                         f"sequence {r.seq_id}: lora {r.lora!r}: its adapter is "
                         f"{seq.adapter_name or 'none'}, set by its START for its life")
            return None
        if not r.tokens:
            if r.end and not r.start:
                self.state.release(seq, ended=True)
                r.reply(Reply(kv_pages=(0, 0)))
                return None
            self._refuse(r, INVALID_ARG, "empty", f"sequence {r.seq_id}: TOKENS is empty")
            return None
        if seq.dropped and r.draft_tokens:
            # The call that computes its history again checks no draft: the model's own next
            # token answers, as when none is accepted.
            r.tokens, r.draft_tokens, r.drafts_unchecked = r.tokens[:-r.draft_tokens], 0, True
        # A START's adapter slot, once nothing above refused it (given back below if it is
        # refused or waits for pages after all)
        if r.start and r.lora is not None and not self._take_adapter(r, seq):
            return None
        try:
            if r.draft_tokens:
                engine.verifier.check_verify(seq, r.tokens, r.draft_tokens)
            if seq.swapped is not None:
                engine.check_request(seq, r.tokens)  # before its KV moves back
                self.room.with_room(seq, len(r.tokens), jobs, lambda: self.room.swap_in(seq))
            if r.keep_tokens is not None and not r.start:
                # Kept even when what follows is refused: the drafts cut are rejected anyway.
                engine.verifier.rewind(seq, r.keep_tokens)
            before = (len(seq.token_ids), len(seq.pages), len(seq.ring),
                      seq.state_slot is not None, seq.dropped)
            reuse = self.room.with_room(seq, len(r.tokens), jobs,
                                    (lambda: engine.readmit(seq, r.tokens)) if seq.dropped else
                                    (lambda: engine.admit(seq, r.tokens, r.cache_salt)))
        except RequestError as e:
            if r.start:
                self.state.give_back_adapter(seq)
            self._refuse(r, INVALID_ARG, e.reason, f"sequence {r.seq_id}: {e}")
            return None
        except PagesExhausted as e:
            if r.start:
                self.state.give_back_adapter(seq)  # (taken again when it is admitted)
            if not self.room.wait(r, seq, e):
                self._refuse_exhausted(r, e)
            return None
        if r.start:
            self.state.admissions += 1
            seq.admitted = self.state.admissions
            self.sequences[r.seq_id] = seq
            self._started(seq, reuse)
        return Job(r, seq, *before)

    def _update_adapters(self, r: Request) -> None:
        """An adapter load or unload, on this thread (where the registry's slots change)."""
        if self.state.adapters is None:
            self._refuse(r, INVALID_ARG, "adapter", "lora_admin: this model takes no adapters")
            return
        try:
            done = self.state.adapters.update(r.admin)
        except AdapterError as e:
            self._refuse(r, INVALID_ARG, "adapter", f"lora_admin: {e}")
            return
        log.info("%s", done)
        r.reply(Reply(kv_pages=(0, 0)))

    def _take_adapter(self, r: Request, seq: Sequence) -> bool:
        """A START's adapter into a slot for the sequence's life; False: refused, or waiting
        for a slot (every slot in use) up to the wait the host tier's requests have."""
        adapters = self.state.adapters
        if adapters is None:
            self._refuse(r, INVALID_ARG, "adapter", f"sequence {r.seq_id}: lora {r.lora!r}: "
                         f"this model takes no adapters (its artifact has no adapter pools)")
            return False
        try:
            seq.adapter_slot, seq.adapter = adapters.acquire(r.lora)
        except AdapterError as e:
            self._refuse(r, INVALID_ARG, "adapter", f"sequence {r.seq_id}: {e}")
            return False
        except AdapterSlotsBusy as e:
            now = self.clock()
            if r.waiting_since is not None and now - r.waiting_since >= self.room.preempt_wait_s:
                self._refuse(r, UNAVAILABLE, "adapter_slots",
                             f"sequence {r.seq_id}: {e}; waited {now - r.waiting_since:.1f} s "
                             f"(retry when a sequence ends)")
            else:
                self.room.defer(r, "an adapter slot")
            return False
        seq.adapter_name = r.lora
        return True

    def _started(self, seq: Sequence, reuse: Reuse) -> None:
        self.state.observe("prefix", reuse.queried, reuse.reused, reuse.continued, reuse.from_host)
        how = ("its previous turn continued" if reuse.continued else "cached blocks")
        if reuse.from_host:
            how += f", {reuse.from_host} of them from the host tier"
        log.info("sequence %s: START of %d tokens, %d reused (%s)", seq.seq_id,
                 len(seq.token_ids), reuse.reused, how if reuse.reused else "none cached")

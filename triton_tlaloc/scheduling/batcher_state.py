"""What the batcher (batcher.py), its admission (scheduling/admission.py) and its room maker
(scheduling/room.py) share, as one explicit object: the held sequences by id, the requests waiting
for pages, the ids busy in the round, the jobs held back for a compile, the prompts under way, the count of
admissions, and
the engine, host tier, adapter registry, clock and observer they act through. It also owns the two moves all three
make: releasing a sequence and rolling back an admitted job. Pure Python: no Triton or JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..engine.core import Engine
from ..kv.host_tier import HostTier
from ..kv.sequence import Sequence

if TYPE_CHECKING:
    from ..lora.registry import AdapterRegistry
    from .admission import Job, Request


class BatcherState:
    def __init__(self, engine: Engine, host: HostTier | None, clock: Callable[[], float],
                 observe: Callable[..., None], adapters: AdapterRegistry | None = None):
        self.engine = engine
        self.host = host  # the host tier (None: off)
        self.adapters = adapters  # LoRA adapters by name and their slots (None: none taken)
        self.clock = clock
        self.observe = observe  # observe("method", *args): every observer's method
        self.sequences: dict[int | str, Sequence] = {}  # held, by correlation id
        self.waiting: list[Request] = []  # requests waiting for pages, oldest first
        self.retry_waiting = False  # pages were released since they last tried
        self.busy: set = set()  # ids with a request in the round, queued or waiting
        # Jobs held back until an entry they need compiles (admitted, their pages reserved)
        self.held_back: list[Job] = []
        # Prompts admitted and under way: a chunk computed in a mixed step, or deferred while
        # another prompt's chunk rode the step; each goes on in the next round
        self.under_way: list[Job] = []
        self.admissions = 0  # STARTs admitted so far (Sequence.admitted)
        # What room making did in this round's admissions ((what, sequence id): RoundPlan)
        self.moves: list[tuple[str, object]] = []

    def held_back_ids(self) -> set:
        """The sequences whose request is held back until an entry compiles."""
        return {j.seq.seq_id for j in self.held_back}

    def in_flight_ids(self) -> set:
        """The sequences whose admitted request is not answered yet and not in this round:
        held back for a compile, or a prompt under way (neither reclaimed nor swapped out)."""
        return self.held_back_ids() | {j.seq.seq_id for j in self.under_way}

    def admitted(self, seq: Sequence) -> bool:
        """Whether `seq` is a held sequence (not a new START's)."""
        return self.sequences.get(seq.seq_id) is seq

    def release(self, seq: Sequence, ended: bool = False) -> None:
        """The sequence is no longer held for its id. Ended by its client (END): kept whole
        for a next turn while pages allow; otherwise (reclaimed, a failed START) freed. A
        swapped-out sequence's host copy is released."""
        if self.sequences.get(seq.seq_id) is seq:
            del self.sequences[seq.seq_id]
        self.retry_waiting = True
        if seq.swapped is not None:
            self.host.drop(seq)
        self.give_back_adapter(seq)
        if ended:
            self.engine.finish(seq)
        else:
            self.engine.free(seq)

    def give_back_adapter(self, seq: Sequence) -> None:
        """The sequence no longer uses its adapter's slot (it keeps the adapter's identity:
        its kept blocks stay keyed by it)."""
        if seq.adapter_slot:
            self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = 0
            self.retry_waiting = True

    def roll_back(self, job: Job) -> bool:
        """Undo an admitted job whose call failed or was preempted (Engine.rollback); a
        sequence that was dropped is dropped again. False: its state cannot be rewound."""
        kept = self.engine.rollback(job.seq, job.num_tokens, job.num_pages, job.num_ring,
                                    job.had_state_slot)
        if job.was_dropped and kept:
            self.engine.drop(job.seq)
        return kept

"""A sequence: the state the backend keeps for one Triton correlation id (nano-vllm keeps it on
its Sequence too). Pure Python.

Its tokens, how many of them have KV in the pools, the pages that hold them (in logical order),
its ring of windowed pages (schema v3), its linear-attention state slot (schema v4), and for
prefix reuse the root of its block hashes (the model's hash and the request's cache salt) and
the hash of each full block computed so far; while it is swapped out, its KV on the host (it
then holds no page, ring page or state slot, and keeps its tokens and hashes); once dropped to
make room, nothing but its tokens and its root (vLLM's preemption by recomputation); and its
status (SequenceStatus), which every change of where it is goes through.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .page_pools import FULL, STATE, WINDOWED

_ids = itertools.count(1)


class SequenceStatus(enum.Enum):
    """Where a sequence is (vLLM's RequestStatus, for a sequence that lives across requests).
    Every change goes through `Sequence.move_to`, which refuses one `NEXT` does not allow."""

    WAITING = "waiting"  # not admitted yet: a START's sequence before its pages are reserved
    RUNNING = "running"  # held, its KV on the device
    HELD_FOR_COMPILE = "held for compile"  # held, its admitted call waits for an entry
    SWAPPED = "swapped"  # held, its KV on the host
    PREEMPTED = "preempted"  # held, its KV given up: its next request computes it again
    KEPT = "kept"  # ended by its client, kept whole for its conversation's next turn
    FINISHED = "finished"  # released


_S = SequenceStatus
NEXT: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.RUNNING: frozenset({_S.HELD_FOR_COMPILE, _S.SWAPPED, _S.PREEMPTED, _S.KEPT,
                           _S.FINISHED}),
    _S.HELD_FOR_COMPILE: frozenset({_S.RUNNING, _S.KEPT, _S.FINISHED}),
    _S.SWAPPED: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.KEPT: frozenset({_S.FINISHED}),
    _S.FINISHED: frozenset(),
}
HELD = frozenset({_S.RUNNING, _S.HELD_FOR_COMPILE, _S.SWAPPED, _S.PREEMPTED})


@dataclass
class Sequence:
    token_ids: list[int]
    seq_id: int | str = field(default_factory=lambda: next(_ids))
    num_cached: int = 0  # tokens whose K/V are in the pool
    pages: list[int] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)  # windowed pages: block b on ring[b % R]
    state_slot: int | None = None  # its linear-attention state slot (schema v4)
    # its LoRA adapter (model.lora): its slot in the adapter pools (0: none) and its identity
    # (a content hash; "" none), which keys its blocks
    adapter_slot: int = 0
    adapter: str = ""
    adapter_name: str = ""  # the name its START gave (lora)
    last_active: float = 0.0  # clock time of its latest request (the backend's reclamation rule)
    root: bytes = b""  # the root of its block hashes: model hash and cache salt (pages.root_hash)
    block_hashes: list[bytes] = field(default_factory=list)  # of blocks 0.. whose KV is computed
    reused: int = 0  # tokens of its first prompt whose KV it found cached (not computed)
    admitted: int = 0  # the order of its START among all admitted (preemption takes the latest)
    swapped: Any = None  # its KV on the host while swapped out (host_tier.SwappedKV)
    status: SequenceStatus = SequenceStatus.WAITING
    # Between its START and its reservation: prompt blocks found on the host tier, written
    # into its pages by the reservation (pages.BlockManager.start).
    from_host: list = field(default_factory=list)
    # Between its START and its reservation: a running sequence's page holding its prompt's
    # positions after the shared blocks, copied into its own page by the reservation
    # (pages.BlockManager.start, kv/open_blocks.py).
    copy_from: int | None = None
    # A call's logits of it held NaN or infinity: its KV may too, so none of its blocks is
    # offered to another sequence (pages.BlockManager.withhold), for the rest of its life.
    nonfinite: bool = False

    def move_to(self, status: SequenceStatus) -> None:
        assert status in NEXT[self.status], \
            f"sequence {self.seq_id}: {self.status.value} cannot become {status.value}"
        self.status = status

    @property
    def dropped(self) -> bool:
        """Its KV was given up to make room (the host tier full): it holds nothing and keeps its
        tokens; its next request computes them again (Engine.readmit)."""
        return self.status is SequenceStatus.PREEMPTED

    @property
    def holding(self) -> dict[str, int]:
        """What it holds in each pool: full-history pages, ring pages, a state slot."""
        return {FULL: len(self.pages), WINDOWED: len(self.ring),
                STATE: int(self.state_slot is not None)}

    @property
    def uncached(self) -> list[int]:
        return self.token_ids[self.num_cached:]

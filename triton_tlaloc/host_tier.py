"""The host tier of the KV cache: sequences swapped out to host memory within a byte budget,
and swapped back in to any free pages (docs/design.md#the-host-tier).

A swap-out copies a sequence's pages (in logical order), its ring pages (in ring order: block
b lives on ring[b % R], so the same order in new pages keeps every block where it was) and
its linear-attention state slot to host arrays through the page transfer programs
(kv_transfer.PageTransfer), then releases them; the sequence keeps its tokens, how many are
computed and its block hashes. A swap-in takes pages again, all or none: leading blocks still
cached on the device (prefix reuse) are shared instead of written, the rest are written from
the host. Which sequences to swap, and when, is the batcher's call (batcher.py); this module
only moves and counts. No Triton; the moves go through an injected transfer (a fake one in the
unit tests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from .kv_transfer import HostPages
from .page_pools import FULL, STATE, WINDOWED
from .pages import BlockManager
from .sequence import Sequence

log = logging.getLogger("triton_tlaloc.host_tier")


class Transfer(Protocol):
    """What the host tier needs of the page transfer programs (kv_transfer.PageTransfer)."""

    def page_bytes(self, pool_class: str) -> int: ...

    def read(self, pool_class: str, pages: list[int]) -> HostPages: ...

    def write(self, host: HostPages, pages: list[int]) -> None: ...


@dataclass
class SwappedKV:
    """A swapped-out sequence's KV on the host, by pool class (what it held: its pages in
    logical order, its ring in ring order, its state slot's row)."""

    parts: dict[str, HostPages]

    def count(self, pool_class: str) -> int:
        part = self.parts.get(pool_class)
        return 0 if part is None else part.count

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())


@dataclass
class Swap:
    """One move, for the log and the metrics."""

    direction: str  # "out" | "in"
    pages: int  # pages, ring pages and state slots moved
    nbytes: int
    seconds: float
    shared: int = 0  # (in) leading pages found still cached on the device, not written


class HostTier:
    """Swapped-out sequences' KV in host memory, at most `budget_bytes` of it."""

    def __init__(self, blocks: BlockManager, transfer: Transfer, budget_bytes: int):
        assert budget_bytes > 0, "a host tier of no bytes: swapping is off"
        self.blocks = blocks
        self.transfer = transfer
        self.budget = budget_bytes
        self.used = 0  # bytes held for swapped-out sequences
        self.sequences = 0  # swapped out now
        self.page_bytes = {c: transfer.page_bytes(c) for c in (FULL, WINDOWED, STATE)}

    def bytes_for(self, seq: Sequence) -> int:
        """Host bytes `seq`'s swap-out would take."""
        return sum(n * self.page_bytes[k] for k, n in seq.holding.items())

    def fits(self, seq: Sequence) -> bool:
        return self.used + self.bytes_for(seq) <= self.budget

    def swap_out(self, seq: Sequence) -> Swap:
        """Copy `seq`'s KV to the host and release its pages (the caller checked `fits`)."""
        assert seq.swapped is None, f"sequence {seq.seq_id} is swapped out already"
        t0 = time.perf_counter()
        parts = {}
        if seq.pages:
            parts[FULL] = self.transfer.read(FULL, seq.pages)
        if seq.ring:
            parts[WINDOWED] = self.transfer.read(WINDOWED, seq.ring)
        if seq.state_slot is not None:
            parts[STATE] = self.transfer.read(STATE, [seq.state_slot])
        moved = sum(seq.holding.values())
        seq.swapped = SwappedKV(parts)
        self.blocks.detach(seq)
        self.used += seq.swapped.nbytes
        self.sequences += 1
        return Swap("out", moved, seq.swapped.nbytes, time.perf_counter() - t0)

    def swap_in(self, seq: Sequence) -> Swap:
        """Give `seq` pages again and write its KV back, or raise PagesExhausted leaving it
        swapped out."""
        kv = seq.swapped
        assert kv is not None, f"sequence {seq.seq_id} is not swapped out"
        t0 = time.perf_counter()
        shared = self.blocks.attach(seq, kv.count(FULL), kv.count(WINDOWED), kv.count(STATE))
        if shared < kv.count(FULL):
            self.transfer.write(kv.parts[FULL].rows(shared), seq.pages[shared:])
        if kv.count(WINDOWED):
            self.transfer.write(kv.parts[WINDOWED], seq.ring)
        if kv.count(STATE):
            self.transfer.write(kv.parts[STATE], [seq.state_slot])
        self.blocks.register_blocks(seq)
        self._release(seq)
        written = sum(seq.holding.values()) - shared
        nbytes = kv.nbytes - shared * self.page_bytes[FULL]
        return Swap("in", written, nbytes, time.perf_counter() - t0, shared)

    def drop(self, seq: Sequence) -> None:
        """A swapped-out sequence is gone (ended, reclaimed): its host copy is released."""
        if seq.swapped is not None:
            self._release(seq)
            seq.num_cached = 0
            seq.block_hashes = []

    def _release(self, seq: Sequence) -> None:
        self.used -= seq.swapped.nbytes
        self.sequences -= 1
        seq.swapped = None
        assert self.used >= 0 and self.sequences >= 0

"""The host tier of the KV cache: sequences swapped out to host memory within a byte budget,
and swapped back in to any free pages (docs/design.md#the-host-tier).

A swap-out copies a sequence's pages (in logical order), its ring pages (in ring order: block
b lives on ring[b % R], so the same order in new pages keeps every block where it was) and
its linear-attention state slot to host arrays through the page transfer programs
(kv_transfer.PageTransfer), then releases them; the sequence keeps its tokens, how many are
computed and its block hashes. A swap-in takes pages again, all or none: leading blocks still
cached on the device (prefix reuse) are shared instead of written, the rest are written from
the host. Which sequences to swap, and when, is the batcher's call (batcher.py); this module
only moves and counts.

With prefix reuse, the tier is also a second level of the prefix cache (pages.BlockSpill):
cached full blocks the device pool evicts are copied here first, keyed by their hash, and a
prompt whose prefix continues into them gets them written into its new pages instead of
computing them. They live in what the budget has left after swapped-out sequences, least
recently used dropped first; a swap-out that needs their room drops them.

No Triton; the moves go through an injected transfer (a fake one in the unit tests).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .page_pools import FULL, STATE, WINDOWED
from ..pages import BlockManager
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("triton_tlaloc.host_tier")


@dataclass
class HostPages:
    """Pages of one pool class on the host: per pool name, [n, ...] (the pool's rows)."""

    pool_class: str
    arrays: dict[str, np.ndarray]

    @property
    def count(self) -> int:
        return len(next(iter(self.arrays.values()))) if self.arrays else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def rows(self, start: int) -> HostPages:
        """The pages from `start` on."""
        return HostPages(self.pool_class, {k: a[start:] for k, a in self.arrays.items()})


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
    """Swapped-out sequences' KV in host memory, at most `budget_bytes` of it, and in what
    they leave of it, full blocks evicted from the device (with prefix reuse)."""

    def __init__(self, blocks: BlockManager, transfer: Transfer, budget_bytes: int):
        assert budget_bytes > 0, "a host tier of no bytes: swapping is off"
        self.blocks = blocks
        self.transfer = transfer
        self.budget = budget_bytes
        self.used = 0  # bytes held for swapped-out sequences
        self.sequences = 0  # swapped out now
        self.page_bytes = {c: transfer.page_bytes(c) for c in (FULL, WINDOWED, STATE)}
        # Evicted blocks by hash, least recently spilled or found first; their bytes.
        self.cached: OrderedDict[bytes, HostPages] = OrderedDict()
        self.cached_bytes = 0
        self.spilled = 0  # blocks copied here as they were evicted
        self.restored = 0  # blocks written back for a prompt
        self.spill_seconds = 0.0
        self.copied_pages = 0  # running sequences' open blocks copied for a prompt
        if blocks.prefix_reuse:
            blocks.spill = self
            blocks.copier = self

    def bytes_for(self, seq: Sequence) -> int:
        """Host bytes `seq`'s swap-out would take."""
        return sum(n * self.page_bytes[k] for k, n in seq.holding.items())

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` can be swapped out (cached blocks give up their room to it)."""
        return self.used + self.bytes_for(seq) <= self.budget

    def swap_out(self, seq: Sequence) -> Swap:
        """Copy `seq`'s KV to the host and release its pages (the caller checked `fits`)."""
        assert seq.swapped is None, f"sequence {seq.seq_id} is swapped out already"
        self._trim(self.bytes_for(seq))
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
        seq.move_to(SequenceStatus.SWAPPED)
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
        seq.move_to(SequenceStatus.RUNNING)
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

    # ------------------------------------------------------------ evicted blocks (BlockSpill)

    def spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """Copy the blocks of these cached pages, about to be evicted, to the host (those not
        kept here already), as many as the budget's free room holds."""
        room = (self.budget - self.used) // max(self.page_bytes[FULL], 1)
        new = [(p, h) for p, h in evicted if h not in self.cached][:room]
        if not new:
            return
        self._trim(len(new) * self.page_bytes[FULL])
        t0 = time.perf_counter()
        rows = self.transfer.read(FULL, [p for p, _ in new])
        for i, (_, h) in enumerate(new):
            # A copy: one block's bytes, released on its own.
            block = HostPages(FULL, {k: a[i:i + 1].copy() for k, a in rows.arrays.items()})
            self.cached[h] = block
            self.cached_bytes += block.nbytes
        self.spilled += len(new)
        self.spill_seconds += time.perf_counter() - t0

    def find(self, h: bytes) -> HostPages | None:
        """The block of hash `h` when it is kept here (now the most recently used)."""
        block = self.cached.get(h)
        if block is not None:
            self.cached.move_to_end(h)
        return block

    def restore(self, blocks: list[HostPages], pages: list[int]) -> None:
        """Write these kept blocks into these pages (one transfer; they stay kept here too)."""
        arrays = {k: np.concatenate([b.arrays[k] for b in blocks]) for k in blocks[0].arrays}
        self.transfer.write(HostPages(FULL, arrays), pages)
        self.restored += len(blocks)

    def copy_page(self, src: int, dst: int) -> None:
        """One full-history page's KV into another (kv/open_blocks.py): read and written back
        by the page transfers (no host bytes kept)."""
        self.transfer.write(self.transfer.read(FULL, [src]), [dst])
        self.copied_pages += 1

    def _trim(self, room: int) -> None:
        """Drop kept blocks, least recently used first, until `room` more bytes fit."""
        while self.cached and self.used + self.cached_bytes + room > self.budget:
            _, block = self.cached.popitem(last=False)
            self.cached_bytes -= block.nbytes

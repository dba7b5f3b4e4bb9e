"""One manager per kind of KV cache a sequence holds (vLLM v1's one manager per cache type):
full-history pages, the ring of a sliding window's pages, a linear-attention state slot. Each
says what a sequence holds of its kind, how much more it needs to grow, how to take it, give it
back past a cut, and check its books; pages.BlockManager coordinates them, so a new kind (an
adapter pool, a draft model's KV, routing state) is a new class here. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Iterable

from .page_pools import FULL, STATE, WINDOWED, PagePool, SharedPagePool

if TYPE_CHECKING:
    from .sequence import Sequence


class CacheKind:
    """What every kind answers; `name` is its pool's (page_pools.FULL, WINDOWED, STATE)."""

    name: str
    pool: PagePool | SharedPagePool
    rebuildable = False  # its contents can be rebuilt from shared full blocks (prefix reuse)
    rewinds = True  # a sequence can be cut back to fewer tokens

    def held(self, seq: Sequence) -> list[int]:
        """The pages (or slots) `seq` holds of this kind, in order (its own list, where it
        keeps one)."""
        raise NotImplementedError

    def need(self, seq: Sequence, blocks: int) -> int:
        """How many more `seq` must take to hold `blocks` blocks of positions."""
        raise NotImplementedError

    def take(self, seq: Sequence, n: int) -> None:
        """Give `seq` `n` more (the coordinator checked they are free). By default `held` is
        the sequence's own list of pages, extended in place."""
        self.held(seq).extend(self.pool.allocate(n))

    def keep_first(self, seq: Sequence, n: int) -> None:
        """Give back what `seq` holds past its first `n` (by default, from its own list)."""
        held = self.held(seq)
        extra = held[n:]
        del held[n:]
        self.pool.release(extra)

    def can_roll_back(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can be put back to `num_tokens` tokens (a failed call undone)."""
        return True

    def kept(self, ended: Iterable[Sequence]) -> int:
        """How many only kept (ended) sequences hold."""
        return sum(len(self.held(s)) for s in ended)

    def usage(self, ended: Iterable[Sequence]) -> tuple[int, int, int]:
        """(held by live sequences, cached or held only by kept ones, free)."""
        kept = self.kept(ended)
        return self.pool.used - kept, kept, self.pool.free

    def check(self, holders: list[Sequence], ended: list[Sequence]) -> None:
        """Its books against every holder (live and kept): nothing held twice or lost."""
        held = [p for s in holders for p in self.held(s)]
        assert len(held) == len(set(held)) == self.pool.used, f"{self.name} pool: held twice"
        self.pool.check()


class FullPages(CacheKind):
    """Full-history pages: reference-counted, shared between sequences through block hashes,
    cached when nobody holds them (page_pools.SharedPagePool). `holds` False: a model whose
    every layer is windowed needs none."""

    name = FULL
    rebuildable = True

    def __init__(self, num_blocks: int, holds: bool = True):
        self.pool = SharedPagePool(num_blocks, FULL)
        self.holds = holds

    def held(self, seq: Sequence) -> list[int]:
        return seq.pages

    def need(self, seq: Sequence, blocks: int) -> int:
        return max(0, blocks - len(seq.pages)) if self.holds else 0

    def usage(self, ended: Iterable[Sequence]) -> tuple[int, int, int]:
        cached = self.pool.cached + self.pool.kept_only
        free = self.pool.free - self.pool.cached
        return self.pool.capacity - cached - free, cached, free

    def check(self, holders: list[Sequence], ended: list[Sequence]) -> None:
        """Each page's count is the number of sequences (live or kept) holding it."""
        pool = self.pool
        counts = Counter(p for s in holders for p in s.pages)
        kept = Counter(p for s in ended for p in s.pages)
        for p in range(pool.num_blocks):
            assert pool.refs[p] == counts.get(p, 0), \
                f"page {p}: count {pool.refs[p]}, held by {counts.get(p, 0)} sequences"
            assert pool.kept[p] == kept.get(p, 0), \
                f"page {p}: {pool.kept[p]} kept holds, {kept.get(p, 0)} kept sequences"
        pool.check()
        for s in holders:
            assert len(set(s.pages)) == len(s.pages), f"sequence {s.seq_id} holds a page twice"
            for p, h in zip(s.pages, s.block_hashes):
                assert pool.block_of(p) in (None, h), f"page {p} holds another block"


class RingPages(CacheKind):
    """A sliding window's ring: at most `ring_pages` pages a sequence, block b on ring[b % R],
    never shared (a ring holds only the window's last positions)."""

    name = WINDOWED

    def __init__(self, num_blocks: int, ring_pages: int):
        self.pool = PagePool(num_blocks, WINDOWED)
        self.ring_pages = ring_pages

    def held(self, seq: Sequence) -> list[int]:
        return seq.ring

    def need(self, seq: Sequence, blocks: int) -> int:
        return max(0, min(blocks, self.ring_pages) - len(seq.ring))


class StateSlots(CacheKind):
    """A linear-attention state slot, one a sequence: every position folded together, so it
    can neither be shared nor cut back."""

    name = STATE
    rewinds = False

    def __init__(self, num_slots: int):
        self.pool = PagePool(num_slots, STATE, reserved=0, unit="slots")

    def held(self, seq: Sequence) -> list[int]:
        return [] if seq.state_slot is None else [seq.state_slot]

    def need(self, seq: Sequence, blocks: int) -> int:
        return 0 if seq.state_slot is not None else 1

    def take(self, seq: Sequence, n: int) -> None:
        if n:
            seq.state_slot = self.pool.allocate(1)[0]

    def keep_first(self, seq: Sequence, n: int) -> None:
        if n == 0 and seq.state_slot is not None:
            # Not cleared: the next sequence given this slot starts at position 0, and a row
            # starting at position 0 starts from zero state.
            self.pool.release([seq.state_slot])
            seq.state_slot = None

    def can_roll_back(self, seq: Sequence, num_tokens: int) -> bool:
        """Not once the state holds some of the tokens to undo (a chunked prompt failing after
        its first chunks)."""
        return seq.num_cached <= num_tokens

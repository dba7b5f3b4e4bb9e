"""The pools pages come from, and the hashes that name a block's contents. Pure Python.

`PagePool` is a free list (ring pages, state slots: never shared). `SharedPagePool` is the
full-history pool: reference-counted pages, the hashes of full computed blocks, and the cache of
pages no sequence holds that still hold a known block, evicted least recently released first
(docs/design.md#kv-reuse). pages.BlockManager uses both.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict, deque
from hashlib import blake2b

FULL, WINDOWED, STATE = "full", "windowed", "state"
POOLS = (FULL, WINDOWED, STATE)

HASH_BYTES = 16  # blake2b digest size: a collision would serve another prompt's KV


class PagesExhausted(RuntimeError):
    """Not enough free pages or slots; the message says how many were asked for and are free
    in each pool short of them, `pools` names those pools."""

    def __init__(self, message: str, pools: tuple[str, ...] = ()):
        super().__init__(message)
        self.pools = pools


def pages_for(length: int, block_size: int) -> int:
    """Pages needed to hold `length` positions."""
    return -(-length // block_size)


def root_hash(model_hash: str, salt: str = "", adapter: str = "") -> bytes:
    """The parent of a sequence's first block: two models, two cache salts, or two LoRA
    adapters (by content hash; "" none) share nothing."""
    key = f"tlaloc-kv\0{model_hash}\0{salt}" + (f"\0lora:{adapter}" if adapter else "")
    return blake2b(key.encode(), digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, tokens) -> bytes:
    """The hash of a full block: its parent's hash and its own tokens."""
    h = blake2b(parent, digest_size=HASH_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PagePool:
    """Free pages of one pool that is never shared (rings, state slots); pages are ints in
    `reserved` .. num_blocks - 1 (a KV pool keeps page 0 back; a state-slot pool, unit "slots",
    gives every slot)."""

    def __init__(self, num_blocks: int, name: str = FULL, reserved: int = 1,
                 unit: str = "pages"):
        assert num_blocks > reserved, f"{name} pool: {num_blocks} {unit}, none to give"
        self.name = name
        self.unit = unit
        self.num_blocks = num_blocks
        self.capacity = num_blocks - reserved
        self._free: deque[int] = deque(range(reserved, num_blocks))
        self._used: set[int] = set()

    def shortage(self, n: int) -> str | None:
        """Why `n` more cannot be given, or None when they can."""
        if n <= self.free:
            return None
        return f"{self.name} pool: {n} {self.unit} needed, {self.free} free of {self.capacity}"

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if (short := self.shortage(n)) is not None:
            raise PagesExhausted(short, (self.name,))
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert p in self._used, f"{self.name} pool: page {p} released but not held"
            self._used.remove(p)
            self._free.append(p)

    def check(self) -> None:
        assert not self._used & set(self._free), f"{self.name} pool: a page both free and held"
        assert len(self._used) + len(self._free) == self.capacity, f"{self.name} pool: lost pages"


class SharedPagePool:
    """The full-history pool: reference-counted pages, the hashes of the full ones, and the
    cache of pages no sequence holds that still hold a known block. Of each page's holds it
    also counts those of ended sequences kept for a next turn (`keep`), so the pages only they
    hold (`kept_only`, cached in the usage gauges) are known without a walk over them."""

    def __init__(self, num_blocks: int, name: str = FULL, reserved: int = 1):
        assert num_blocks > reserved, f"{name} pool: {num_blocks} pages, none to give"
        self.name = name
        self.unit = "pages"
        self.num_blocks = num_blocks
        self.reserved = reserved
        self.capacity = num_blocks - reserved
        self.refs = [0] * num_blocks
        # Of each page's holds, those of sequences kept for a next turn (pages.BlockManager),
        # and how many pages only such sequences hold (cached, in the usage gauges).
        self.kept = [0] * num_blocks
        self.kept_only = 0
        self._uncached: deque[int] = deque(range(reserved, num_blocks))  # count 0, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()  # count 0, hashed; evicted first
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.evicted = 0  # cached pages given to another block so far

    @property
    def free(self) -> int:
        """Pages a request can take: uncached ones, then cached ones evicted."""
        return len(self._uncached) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def shortage(self, n: int) -> str | None:
        if n <= self.free:
            return None
        return f"{self.name} pool: {n} pages needed, {self.free} free of {self.capacity}"

    def allocate(self, n: int) -> list[int]:
        """`n` pages, each held once: uncached pages first, then the cached least recently
        released (their blocks are forgotten)."""
        if (short := self.shortage(n)) is not None:
            raise PagesExhausted(short, (self.name,))
        pages = []
        for _ in range(n):
            if self._uncached:
                p = self._uncached.popleft()
            else:
                p, _ = self._cached.popitem(last=False)
                self._forget(p)
                self.evicted += 1
            self.refs[p] = 1
            pages.append(p)
        return pages

    def evictions(self, n: int) -> list[tuple[int, bytes]]:
        """The cached pages (with their blocks' hashes) that allocating `n` would evict."""
        k = n - len(self._uncached)
        if k <= 0:
            return []
        return [(p, self._hash_of[p]) for p in itertools.islice(self._cached, k)]

    def page_of(self, h: bytes) -> int | None:
        """The page holding the block of hash `h`, None when no page does."""
        return self._page_of.get(h)

    def lookup(self, hashes) -> list[int]:
        """The pages of the longest leading run of `hashes` (an iterable, read lazily) that
        this pool holds."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def share(self, pages: list[int]) -> None:
        """Hold these (hashed) pages once more; a cached one leaves the cache."""
        for p in pages:
            assert p in self._hash_of, f"{self.name} pool: page {p} shared but holds no block"
            if self.refs[p] == 0:
                del self._cached[p]
            self._count(p, holds=1)

    def hold(self, page: int) -> None:
        """Hold a page once more whether or not it holds a block (a copy's source, held or
        cached, kept from evictions until it is copied); `release` lets it go."""
        if self.refs[page] == 0:
            del self._cached[page]
        self._count(page, holds=1)

    def release(self, pages: list[int]) -> None:
        """Drop one hold on each page, last page first: a page nobody holds is cached when it
        holds a known block, free otherwise."""
        for p in reversed(pages):
            assert self.refs[p] > 0, f"{self.name} pool: page {p} released but not held"
            self._count(p, holds=-1)
            if self.refs[p] == 0:
                if p in self._hash_of:
                    self._cached[p] = None
                else:
                    self._uncached.append(p)

    def keep(self, pages: list[int]) -> None:
        """These held pages' holder has ended and is kept for its next turn."""
        for p in pages:
            self._count(p, kept=1)

    def unkeep(self, pages: list[int]) -> None:
        """Their kept holder is taken over or dropped: its holds are plain holds again."""
        for p in pages:
            self._count(p, kept=-1)

    def _count(self, p: int, holds: int = 0, kept: int = 0) -> None:
        was = 0 < self.refs[p] == self.kept[p]
        self.refs[p] += holds
        self.kept[p] += kept
        assert 0 <= self.kept[p] <= self.refs[p], f"{self.name} pool: page {p} kept unheld"
        self.kept_only += (0 < self.refs[p] == self.kept[p]) - was

    def register(self, page: int, h: bytes) -> None:
        """A held page's block is full and computed: other prompts may share it. When another
        page holds the same block already, this one stays unregistered (one page per block)."""
        assert self.refs[page] > 0, f"{self.name} pool: page {page} registered but not held"
        if page in self._hash_of or h in self._page_of:
            return
        self._hash_of[page] = h
        self._page_of[h] = page

    def unregister(self, page: int) -> None:
        """Its holder is about to write over the block (a rolled-back call): forget it."""
        if page in self._hash_of:
            assert self.refs[page] == 1, f"{self.name} pool: page {page} is shared"
            self._forget(page)

    def block_of(self, page: int) -> bytes | None:
        """The hash of the block `page` holds, None when it holds no registered block."""
        return self._hash_of.get(page)

    def _forget(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]

    def check(self) -> None:
        """The pool's invariants (the tests call it after every operation)."""
        free = set(self._uncached)
        assert len(free) == len(self._uncached), f"{self.name} pool: a page free twice"
        assert not free & set(self._cached), f"{self.name} pool: a page free and cached"
        held = {p for p in range(self.reserved, self.num_blocks) if self.refs[p] > 0}
        assert all(r >= 0 for r in self.refs), f"{self.name} pool: a negative count"
        assert self.kept_only == sum(0 < r == k for r, k in zip(self.refs, self.kept)), \
            f"{self.name} pool: kept-only pages miscounted"
        assert not held & (free | set(self._cached)), f"{self.name} pool: a page free and held"
        assert len(held) + len(free) + len(self._cached) == self.capacity, \
            f"{self.name} pool: pages lost"
        assert all(self.refs[p] == 0 for p in range(self.reserved)), "reserved page handed out"
        assert all(p in self._hash_of for p in self._cached), "a cached page without a block"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash maps differ"
        assert len(self._page_of) == len(self._hash_of), "hash maps differ"

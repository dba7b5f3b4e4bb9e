"""Page pools: which KV pages each sequence holds. Pure Python, no JAX, no Triton.

Page 0 is never handed out: padding rows' block tables point at it, so a padding row reads a
page no sequence owns and (its slots being -1) writes nothing.
"""

from __future__ import annotations

from collections import deque


class PagesExhausted(RuntimeError):
    """Not enough free pages; the message says how many were asked for and are free."""


def pages_for(length: int, block_size: int) -> int:
    """Pages needed to hold `length` positions."""
    return -(-length // block_size)


class PagePool:
    """Free pages of one pool; pages are ints in 1 .. num_blocks - 1."""

    def __init__(self, num_blocks: int, name: str = "full"):
        assert num_blocks >= 2, "a pool needs page 0 and at least one page to give"
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PagesExhausted(f"{self.name} pool: {n} pages needed, {len(self._free)} free "
                                 f"of {self.num_blocks - 1}")
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert p in self._used, f"{self.name} pool: page {p} released but not held"
            self._used.remove(p)
            self._free.append(p)

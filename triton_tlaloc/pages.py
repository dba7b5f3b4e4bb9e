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


def choose_reclaim(candidates: list[tuple[object, object, float]], need, now: float,
                   idle_limit: float) -> list[object]:
    """Which sequences to reclaim so that `need` more pages are free.

    candidates: (sequence id, pages held, last activity time); need: pages wanted. Pages are an
    int, or a dict by pool ({"full": 3, "windowed": 1}) when a model has a windowed pool. Only
    sequences idle longer than `idle_limit` qualify: Triton has ended them (it sends no END for
    a sequence it times out), so no client can continue them. Least recently active first, and
    only as many as `need`. When the qualifying sequences cannot free `need` pages, nothing is
    reclaimed: the request is refused and no sequence loses its KV for nothing.
    """
    def as_dict(pages):
        return pages if isinstance(pages, dict) else {"full": pages}

    need = {k: v for k, v in as_dict(need).items() if v > 0}
    idle = sorted((c for c in candidates if now - c[2] > idle_limit
                   and any(as_dict(c[1]).values())), key=lambda c: c[2])
    chosen, freed = [], dict.fromkeys(need, 0)

    def covered():
        return all(freed[k] >= v for k, v in need.items())

    for seq_id, pages, _ in idle:
        if covered():
            break
        chosen.append(seq_id)
        for k in freed:
            freed[k] += as_dict(pages).get(k, 0)
    return chosen if covered() else []

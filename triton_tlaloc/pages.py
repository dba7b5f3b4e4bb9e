"""Page pools: which KV pages and which linear-attention state slots each sequence holds. Pure
Python, no JAX, no Triton.

Page 0 of a KV pool is never handed out: padding rows' block tables point at it, so a padding
row reads a page no sequence owns and (its slots being -1) writes nothing. A state-slot pool
hands out every slot: a padding row's state slot is -1, which the entry neither reads nor
writes.
"""

from __future__ import annotations

from collections import deque


class PagesExhausted(RuntimeError):
    """Not enough free pages or slots; the message says how many were asked for and are free
    in each pool short of them, `pools` names those pools."""

    def __init__(self, message: str, pools: tuple[str, ...] = ()):
        super().__init__(message)
        self.pools = pools


def pages_for(length: int, block_size: int) -> int:
    """Pages needed to hold `length` positions."""
    return -(-length // block_size)


class PagePool:
    """Free pages of one pool; pages are ints in `reserved` .. num_blocks - 1 (a KV pool keeps
    page 0 back; a state-slot pool, unit "slots", gives every slot)."""

    def __init__(self, num_blocks: int, name: str = "full", reserved: int = 1,
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
        if n <= len(self._free):
            return None
        return f"{self.name} pool: {n} {self.unit} needed, {len(self._free)} free of {self.capacity}"

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


def choose_reclaim(candidates: list[tuple[object, object, float]], need, now: float,
                   idle_limit: float) -> list[object]:
    """Which sequences to reclaim so that `need` more pages are free.

    candidates: (sequence id, pages held, last activity time); need: pages wanted. Pages are an
    int, or a dict by pool ({"full": 3, "windowed": 1, "state": 1}) when a model has a windowed
    pool or state slots. Only
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

"""Blocks of held sequences not yet full, found by what comes before them, so that a prompt
whose cached prefix ends inside such a block gets a copy of its page instead of computing its
positions again: n choices of one prompt, started once the first has computed it, or the same
prompt sent twice (docs/design.md#kv-reuse).

Full blocks are shared by hash (kv/page_pools.py); a block still open cannot be: its sequence
goes on writing into it. Its first positions are final, though, and a copy of its page holds
them: the new sequence computes only its prompt's last token (its logits are the answer), as a
decode row. Pure Python: the copy itself is the host tier's (`PageCopy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .sequence import SequenceStatus

if TYPE_CHECKING:
    from .sequence import Sequence

# Holding no pages of their own (or none it can be sure of)
GONE = (SequenceStatus.FINISHED, SequenceStatus.PREEMPTED, SequenceStatus.SWAPPED)


class PageCopy(Protocol):
    """Copies a full-history page's KV into another page (every layer), on the device."""

    def copy_page(self, src: int, dst: int) -> None: ...


class OpenBlocks:
    """Each held sequence's blocks that were open (partly computed) when it was registered, by
    the hash of the block before them (or its root, for its first block): running sequences'
    and those ended and kept whole for a next turn (n choices: choice 0 may end before the
    others start)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.by_parent: dict[bytes, tuple[Sequence, int]] = {}
        self.keys: dict[int, list[bytes]] = {}  # id(seq): its entries' keys

    def update(self, seq: Sequence) -> None:
        """`seq`'s blocks were registered: its open block, if it has one, can be found."""
        b = len(seq.block_hashes)
        if seq.num_cached % self.block_size == 0 or len(seq.pages) <= b:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root
        if self.by_parent.get(parent) != (seq, b):
            self.by_parent[parent] = (seq, b)
            self.keys.setdefault(id(seq), []).append(parent)

    def forget(self, seq: Sequence) -> None:
        """`seq` holds its pages no more (freed, swapped out, dropped, taken over)."""
        for key in self.keys.pop(id(seq), ()):
            if self.by_parent.get(key, (None,))[0] is seq:
                del self.by_parent[key]

    def page_for(self, parent: bytes, root: bytes, tokens: list[int]) -> int | None:
        """The page of a held sequence whose block after `parent` begins with `tokens`,
        computed (its KV final), or None."""
        found = self.by_parent.get(parent)
        if found is None or not tokens:
            return None
        seq, b = found
        if seq.status in GONE:
            return None
        start = b * self.block_size
        if b > len(seq.block_hashes):  # cut back below it
            return None
        before = seq.block_hashes[b - 1] if b else seq.root
        if (seq.root != root or before != parent or len(seq.pages) <= b
                or seq.num_cached < start + len(tokens)
                or seq.token_ids[start:start + len(tokens)] != tokens):
            return None  # it was cut back, or its tokens there are others now
        return seq.pages[b]


__all__ = ["OpenBlocks", "PageCopy"]

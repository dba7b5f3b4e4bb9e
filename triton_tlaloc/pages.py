"""KV pages: which pages and state slots each sequence holds, which pages hold a known prefix,
and which ended sequences can be continued. Pure Python, no JAX, no Triton
(docs/design.md#kv-reuse).

Three pools, by name:

- FULL: full-history pages. Each has a reference count; a page whose block is full and computed
  carries a hash chained from its parent block's (`block_hash`), rooted in the model's hash and
  the request's cache salt (`root_hash`), so equal hashes mean equal tokens at equal positions
  under the same model: the same KV. A page whose count falls to 0 keeps its hash and stays
  cached until a request needs a page and no uncached one is free; then it is evicted, least
  recently released first and, among pages released together, the deepest block first (a
  sequence's pages are released last block first), so shared roots outlive their branches.
- WINDOWED: ring pages of sliding-window layers (schema v3); STATE: linear-attention state slots
  (schema v4). Neither can be shared: a ring holds only the window's last positions and a state
  all of them folded together. They are plain free lists.

Page 0 of a KV pool is never handed out: padding rows' block tables point at it, so a padding
row reads a page no sequence owns and (its slots being -1) writes nothing. A state-slot pool
hands out every slot: a padding row's state slot is -1, which the entry neither reads nor
writes.

Each kind of cache is a manager of its own (kv/cache_kinds.py: FullPages, RingPages, StateSlots),
and `BlockManager` coordinates them: it does all the accounting per sequence: what a sequence
needs to grow, taking it (all or nothing), rolling a failed call back, freeing, reusing cached
blocks on a prompt, and
keeping ended sequences whole so that the next turn of a conversation continues them. With a
host tier (`BlockSpill`, host_tier.HostTier), cached blocks are copied to host memory as they
are evicted, and a prompt's prefix continues into the blocks found there: they are written into
the new pages its reservation takes instead of computed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .model_parameters import default_int
from .kv.cache_kinds import CacheKind, FullPages, RingPages, StateSlots
from .kv.open_blocks import OpenBlocks, PageCopy
from .kv.page_pools import (FULL, POOLS, STATE, WINDOWED, PagePool, PagesExhausted, SharedPagePool,
                            block_hash, pages_for, root_hash)
from .kv.sequence import HELD, SequenceStatus

__all__ = ["FULL", "POOLS", "STATE", "WINDOWED", "BlockManager", "PagePool", "PagesExhausted",
           "PoolShape", "Reuse", "SharedPagePool", "block_hash", "pages_for", "pool_shape",
           "root_hash"]

if TYPE_CHECKING:
    from .artifact.manifest import Artifact
    from .kv.sequence import Sequence


class BlockSpill(Protocol):
    """Where evicted cached blocks go (host_tier.HostTier): full blocks kept by hash."""

    def spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """These cached pages (page, block hash) are about to be given to other blocks."""

    def find(self, h: bytes) -> Any:
        """The block of hash `h` when it is kept, else None."""

    def restore(self, blocks: list, pages: list[int]) -> None:
        """Write these blocks (found by `find`) into these pages, in order."""


@dataclass(frozen=True)
class PoolShape:
    """What a model's pools hold (`pool_shape` reads it off the artifact)."""

    num_blocks: int
    block_size: int
    holds_full_pages: bool = True  # False: every layer is windowed (mistral)
    ring_blocks: int = 0  # pages of the windowed pool (0: none)
    ring_pages: int = 0  # pages in one sequence's ring
    state_slots: int = 0  # linear-attention state slots (0: none)
    model_hash: str = ""


def pool_shape(art: Artifact) -> PoolShape:
    """What the artifact's pools hold, for the block manager."""
    windowed, ls = art.windowed, art.linear_state
    return PoolShape(
        num_blocks=art.model.num_blocks, block_size=art.model.block_size,
        # A model whose every layer is windowed (mistral) has no full-history pools to page.
        holds_full_pages=any(p.pool_class == FULL for p in art.pools),
        ring_blocks=windowed.num_blocks if windowed else 0,
        ring_pages=windowed.ring_pages if windowed else 0,
        state_slots=ls.num_slots if ls is not None else 0, model_hash=art.model.model_hash)


@dataclass
class Reuse:
    """What a prompt found cached at its START: tokens whose KV it did not compute, and whether
    they came from an ended sequence taken over whole (a continued turn)."""

    queried: int = 0
    reused: int = 0  # of them, on the device or on the host
    from_host: int = 0  # of them, written back from the host tier
    copied: int = 0  # of them, copied from another sequence's page
    taken: Sequence | None = field(default=None, repr=False)  # the ended sequence continued
    order: list = field(default_factory=list, repr=False)  # the kept sequences' order before

    @property
    def continued(self) -> bool:
        return self.taken is not None


class BlockManager:
    """All page accounting of one model's pools, per sequence (nano-vllm's BlockManager, with
    rings, state slots and ended sequences kept whole).

    prefix_reuse: a prompt attaches the cached full blocks its block-aligned prefix matches and
    computes only the rest; a sequence's full blocks are registered as they are computed, and
    freed pages stay cached. Only for models whose history is all in full pages (no rings, no
    state slots: those cannot be rebuilt from shared blocks).
    keep_ended: how many ended sequences are kept whole (pages, ring, state slot) for the next
    turn of their conversation; least recently ended dropped first, and all of them before a
    request is refused for want of pages.
    """

    def __init__(self, shape: PoolShape, prefix_reuse: bool = True,
                 keep_ended: int = default_int("keep_ended_sequences")):
        self.shape = shape
        self.block_size = shape.block_size
        self.ring_pages = shape.ring_pages
        # One manager per kind of cache the model has (kv/cache_kinds.py), by pool name.
        full = FullPages(shape.num_blocks, shape.holds_full_pages)
        self.kinds: dict[str, CacheKind] = {FULL: full}
        if shape.ring_blocks:
            self.kinds[WINDOWED] = RingPages(shape.ring_blocks, shape.ring_pages)
        if shape.state_slots:
            self.kinds[STATE] = StateSlots(shape.state_slots)
        self.full = full.pool
        # Whether a sequence can be cut back (no kind, like a state, folds every token in)
        self.rewinds = all(k.rewinds for k in self.kinds.values())
        self.prefix_reuse = (prefix_reuse and shape.holds_full_pages
                             and all(k.rebuildable for k in self.kinds.values()))
        self.keep_ended = keep_ended if prefix_reuse else 0
        self.ended: OrderedDict[int, Sequence] = OrderedDict()  # by id(seq), least recent first
        self.dropped = 0  # ended sequences dropped (for pages, or past keep_ended)
        self.continued = 0  # ended sequences taken over by a new prompt
        self.spill: BlockSpill | None = None  # set by a host tier (prefix reuse only)
        # Held sequences' open blocks, copied for a prompt that continues into one (set with
        # `copier`, by a host tier: its page transfers copy; prefix reuse only)
        self.open_blocks = OpenBlocks(self.block_size)
        self.copier: PageCopy | None = None
        self.copied = 0  # tokens a prompt found in another's open block (copied, not computed)

    def pools(self) -> dict[str, PagePool | SharedPagePool]:
        return {name: kind.pool for name, kind in self.kinds.items()}

    # ------------------------------------------------------------ growing

    def need(self, seq: Sequence, length: int) -> dict[str, int]:
        """Pages per pool `seq` must add to hold `length` positions: full-history pages for
        every block, ring pages up to the ring's size, a state slot once."""
        blocks = pages_for(length, self.block_size)
        return {name: kind.need(seq, blocks) for name, kind in self.kinds.items()}

    def reserve(self, seq: Sequence, length: int) -> None:
        """Take the pages `seq` needs to hold `length` positions, all or none: cached blocks
        are evicted, then ended sequences dropped (least recently ended first), before
        PagesExhausted names each pool still short."""
        self._take(seq, self.need(seq, length))
        if seq.from_host:
            self._restore(seq)
        if seq.copy_from is not None:  # the page after its shared blocks: another's copy
            self.copier.copy_page(seq.copy_from, seq.pages[len(seq.block_hashes)])
            self.full.release([seq.copy_from])
            seq.copy_from = None
        if seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            seq.move_to(SequenceStatus.RUNNING)  # admitted (again)

    def _take(self, seq: Sequence, need: dict[str, int]) -> None:
        if not any(need.values()):  # most decode steps fill a page they hold already
            return
        pools = self.pools()
        need = {name: n for name, n in need.items() if name in pools}
        short = {name: pools[name].shortage(n) for name, n in need.items()}
        short = {name: why for name, why in short.items() if why is not None}
        if short and not self._ended_could_cover(need):
            # Kept sequences are not dropped for a request they cannot make room for.
            raise PagesExhausted("; ".join(short.values()), tuple(short))
        while any(pools[name].shortage(n) for name, n in need.items()):
            self._drop_ended()
        if self.spill is not None and need.get(FULL):
            if evicted := self.full.evictions(need[FULL]):
                self.spill.spill(evicted)
        for name, n in need.items():
            self.kinds[name].take(seq, n)

    def _ended_could_cover(self, need: dict[str, int]) -> bool:
        """Whether dropping every kept sequence would free what `need` lacks."""
        available = self.available()
        return all(n <= available[name] for name, n in need.items())

    def available(self) -> dict[str, int]:
        """Per pool, what a reservation can take without touching a live sequence: free and
        cached pages, and what only kept ended sequences hold."""
        usage = self.usage()
        return {name: cached + free for name, (_, cached, free) in usage.items()}

    def register(self, seq: Sequence) -> None:
        """Hash the blocks `seq` has filled since the last call, so other prompts can share
        them (the KV of a block is final once its last position is computed). A sequence whose
        logits were not finite registers nothing (`withhold`)."""
        if not self.prefix_reuse or seq.nonfinite:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root
        for b in range(len(seq.block_hashes), seq.num_cached // bs):
            parent = block_hash(parent, seq.token_ids[b * bs:(b + 1) * bs])
            seq.block_hashes.append(parent)
            self.full.register(seq.pages[b], parent)
        if self.copier is not None:
            self.open_blocks.update(seq)

    def withhold(self, seq: Sequence) -> None:
        """A call's logits of `seq` held NaN or infinity (the engine calls this in place of
        `register`): its KV may hold them too, and a page's contents must never reach another
        sequence's result. So from now on none of its blocks is offered to another: the blocks
        it registered that only it holds are forgotten (they are never cached, so never
        evicted to the host tier, whose spill takes cached blocks only), its open block is not
        copied for another prompt, it registers nothing more (nor when swapped back in), and
        once ended it is freed rather than kept for a next turn. Blocks other sequences hold
        too were published by calls whose logits were finite, and stay."""
        seq.nonfinite = True
        self.open_blocks.forget(seq)
        for page, h in zip(seq.pages, seq.block_hashes):
            if self.full.block_of(page) == h and self.full.refs[page] == 1:
                self.full.unregister(page)

    def check_writes(self, seq: Sequence) -> None:
        """A call writes from position num_cached on: never into a block others may share."""
        assert seq.num_cached // self.block_size >= len(seq.block_hashes), \
            f"sequence {seq.seq_id} would write into a registered block"

    # ------------------------------------------------------------ a prompt's START

    def start(self, seq: Sequence, prompt: list[int], root: bytes) -> Reuse:
        """Before a new sequence reserves pages for `prompt`: take over an ended sequence whose
        history the prompt continues, or attach the cached blocks its prefix matches (and
        count those found on the host, which `reserve` writes into its first new pages). At
        least the prompt's last token is left to compute (its logits are the answer). Undone by
        `unstart` when the reservation fails."""
        assert not seq.token_ids and not seq.pages and seq.state_slot is None
        seq.root = root
        if self.keep_ended == 0 and not self.prefix_reuse:
            return Reuse()
        prefix, on_host = self._prefix(prompt, root) if self.prefix_reuse else ([], [])
        ended = self._continuable(prompt, root)
        found = (len(prefix) + len(on_host)) * self.block_size
        if ended is not None and ended.num_cached >= found:
            order = list(self.ended)
            self._unkeep(ended)
            self.open_blocks.forget(ended)  # its pages are this sequence's now
            seq.pages, seq.ring, seq.state_slot = list(ended.pages), list(ended.ring), \
                ended.state_slot
            seq.block_hashes, seq.num_cached = list(ended.block_hashes), ended.num_cached
            self.continued += 1
            seq.reused = seq.num_cached
            return Reuse(len(prompt), seq.num_cached, taken=ended, order=order)
        self.full.share(prefix)
        seq.pages = list(prefix)
        seq.block_hashes = [self.full.block_of(p) for p in prefix] + [h for h, _ in on_host]
        seq.from_host = [block for _, block in on_host]
        seq.num_cached = len(seq.block_hashes) * self.block_size
        copied = self._copy_open_block(seq, prompt)
        seq.num_cached += copied
        seq.reused = seq.num_cached
        return Reuse(len(prompt) if self.prefix_reuse else 0, seq.num_cached,
                     from_host=len(on_host) * self.block_size, copied=copied)

    def _copy_open_block(self, seq: Sequence, prompt: list[int]) -> int:
        """When the prompt's positions after its cached blocks (all but its last token) are in
        another sequence's page, that page is to be copied by the reservation: a held
        sequence's open block, or when the prompt ends a block, that block cached whole (its
        last token is computed, so it cannot be shared); how many positions the copy gives (0:
        none found). The page is held until it is copied."""
        start, bs = seq.num_cached, self.block_size
        tail = prompt[start:len(prompt) - 1]  # the last token is always computed
        if self.copier is None or not tail or len(tail) >= bs:
            return 0
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root
        page = None
        if len(prompt) - start == bs:  # cached whole, by its hash
            page = self.full.page_of(block_hash(parent, prompt[start:]))
        if page is None:
            page = self.open_blocks.page_for(parent, seq.root, tail)
        if page is None:
            return 0
        self.full.hold(page)  # until it is copied: the reservation may drop its holder
        seq.copy_from = page
        self.copied += len(tail)
        return len(tail)

    def unstart(self, seq: Sequence, reuse: Reuse) -> None:
        """Undo `start` (the prompt was refused): an ended sequence taken over is kept again,
        shared blocks are released."""
        if reuse.taken is not None:  # the reservation took nothing: it holds what it held
            self.continued -= 1
            self._keep(reuse.taken)
            for key in reuse.order:  # back in its place among the kept
                if key in self.ended:
                    self.ended.move_to_end(key)
        else:
            self.full.release(seq.pages)
        if seq.copy_from is not None:
            self.full.release([seq.copy_from])
        self.copied -= reuse.copied
        seq.pages, seq.ring, seq.state_slot = [], [], None
        seq.block_hashes, seq.num_cached, seq.reused, seq.from_host = [], 0, 0, []
        seq.copy_from = None

    def _prefix(self, prompt: list[int], root: bytes) -> tuple[list[int], list[tuple]]:
        """The device pages holding the prompt's leading full blocks, and the blocks after
        them found on the host tier ((hash, block) pairs), up to the first block in neither."""
        bs = self.block_size
        pages, on_host = [], []
        parent = root
        for b in range((len(prompt) - 1) // bs):  # the last token is always computed
            parent = block_hash(parent, prompt[b * bs:(b + 1) * bs])
            page = None if on_host else self.full.page_of(parent)
            if page is not None:
                pages.append(page)
                continue
            block = self.spill.find(parent) if self.spill is not None else None
            if block is None:
                break
            on_host.append((parent, block))
        return pages, on_host

    def _restore(self, seq: Sequence) -> None:
        """Write the blocks `start` found on the host into the pages after the shared prefix
        (the reservation has just taken them) and register them."""
        first = len(seq.block_hashes) - len(seq.from_host)
        pages = seq.pages[first:len(seq.block_hashes)]
        self.spill.restore(seq.from_host, pages)
        for page, h in zip(pages, seq.block_hashes[first:]):
            self.full.register(page, h)
        seq.from_host = []

    def _continuable(self, prompt: list[int], root: bytes) -> Sequence | None:
        """The ended sequence of this root with the longest history that `prompt` begins with
        and goes past (a state or a ring cannot be rewound, so nothing shorter qualifies)."""
        best = None
        for s in self.ended.values():
            n = s.num_cached
            if (s.root == root and n < len(prompt) and (best is None or n > best.num_cached)
                    and s.token_ids[:n] == prompt[:n]):
                best = s
        return best

    # ------------------------------------------------------------ ending

    def rollback(self, seq: Sequence, num_tokens: int, num_pages: int, num_ring: int = 0,
                 had_state_slot: bool = True) -> bool:
        """Undo an admit whose call failed: the sequence as it was before it. False when that
        cannot be: a linear-attention state already holds some of the failed request's tokens
        (a chunked prompt failing after its first chunks), and a state cannot be rewound."""
        if not all(k.can_roll_back(seq, num_tokens) for k in self.kinds.values()):
            return False
        del seq.token_ids[num_tokens:]
        seq.num_cached = min(seq.num_cached, num_tokens)
        # Blocks registered by the failed request's first chunks: those the sequence keeps
        # will be written over by its next request, so they are forgotten first.
        full_blocks = seq.num_cached // self.block_size
        for page in seq.pages[full_blocks:num_pages]:
            self.full.unregister(page)
        del seq.block_hashes[full_blocks:]
        self._keep_first(seq, {FULL: num_pages, WINDOWED: num_ring, STATE: int(had_state_slot)})
        return True

    def _keep_first(self, seq: Sequence, counts: dict[str, int]) -> None:
        """Give back, of each kind, what `seq` holds past its first counts[kind]."""
        for name, kind in self.kinds.items():
            kind.keep_first(seq, counts[name])

    def truncate(self, seq: Sequence, length: int) -> None:
        """Cut `seq` back to its first `length` tokens (drafts a verify call did not accept, or
        a draft model's drafts its target rejected): what was written past them is never read
        and will be written over; the pages and ring pages it no longer needs are released. A
        registered block holding the cut or past it is released whole, never written over
        (other sequences may share it; it stays cached): the next call computes again the
        positions of it that stand. A state cannot be cut back (no state slots)."""
        assert self.rewinds, "a linear-attention state cannot be cut back"
        blocks, seq.num_cached = self._cut(seq, length)
        del seq.block_hashes[blocks:]
        del seq.token_ids[length:]
        self._keep_first(seq, {FULL: blocks, WINDOWED: min(blocks, self.ring_pages)})

    def cached_after_cut(self, seq: Sequence, length: int) -> int:
        """The positions `seq` would still hold computed after `truncate(seq, length)`."""
        return self._cut(seq, length)[1]

    def _cut(self, seq: Sequence, length: int) -> tuple[int, int]:
        """The pages `seq` keeps when cut back to `length` tokens, and its computed length."""
        whole = length // self.block_size
        if len(seq.block_hashes) > whole:  # a registered block holds the cut or lies past it
            return whole, min(seq.num_cached, whole * self.block_size)
        return pages_for(length, self.block_size), min(seq.num_cached, length)

    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds (its registered blocks stay cached): it is finished."""
        self._forget(seq)
        seq.move_to(SequenceStatus.FINISHED)

    def drop(self, seq: Sequence) -> None:
        """Release everything `seq` holds (its registered blocks stay cached) but its tokens and
        root: preempted, its next request computes them again."""
        self._forget(seq)
        seq.move_to(SequenceStatus.PREEMPTED)

    def _forget(self, seq: Sequence) -> None:
        self.detach(seq)
        seq.num_cached = 0
        seq.block_hashes = []

    def finish(self, seq: Sequence) -> None:
        """A sequence ended by its client (END): kept whole for its conversation's next turn
        when there is something to continue, else freed (and so is one whose logits were not
        finite: its KV is no one's next turn)."""
        if self.keep_ended == 0 or seq.num_cached == 0 or seq.nonfinite:
            self.free(seq)
            return
        self._keep(seq)
        while len(self.ended) > self.keep_ended:
            self._drop_ended()

    def _keep(self, seq: Sequence) -> None:
        self.ended[id(seq)] = seq
        self.full.keep(seq.pages)
        if seq.status is not SequenceStatus.KEPT:  # (kept again when a takeover is undone)
            seq.move_to(SequenceStatus.KEPT)

    def _unkeep(self, seq: Sequence) -> None:
        del self.ended[id(seq)]
        self.full.unkeep(seq.pages)

    def _drop_ended(self) -> None:
        seq = next(iter(self.ended.values()))
        self._unkeep(seq)
        self.dropped += 1
        self.free(seq)

    # ------------------------------------------------------------ the host tier

    def detach(self, seq: Sequence) -> None:
        """Release everything `seq` holds but keep what it is (its tokens, how many are
        computed, its block hashes): its KV has been copied to the host (swapped out)."""
        self.open_blocks.forget(seq)
        self._keep_first(seq, {name: 0 for name in self.kinds})

    def attach(self, seq: Sequence, num_pages: int, num_ring: int, state_slots: int) -> int:
        """Give a swapped-out sequence pages again (swapping it in), all or none: its leading
        blocks still cached on the device are shared rather than written; returns how many
        (the first pages, whose KV need not be written). The new pages are registered with
        the sequence's block hashes once written (`register_blocks`)."""
        assert not seq.pages and not seq.ring and seq.state_slot is None
        prefix = (self.full.lookup(iter(seq.block_hashes[:num_pages]))
                  if self.prefix_reuse else [])
        self.full.share(prefix)
        seq.pages = list(prefix)
        try:
            self._take(seq, {FULL: num_pages - len(prefix), WINDOWED: num_ring,
                             STATE: state_slots})
        except PagesExhausted:
            self.full.release(seq.pages)
            seq.pages = []
            raise
        return len(prefix)

    def register_blocks(self, seq: Sequence) -> None:
        """Register the blocks of pages written back from the host (see `attach`); none of a
        sequence whose logits were not finite (`withhold`)."""
        if self.prefix_reuse and not seq.nonfinite:
            for page, h in zip(seq.pages, seq.block_hashes):
                self.full.register(page, h)

    # ------------------------------------------------------------ accounting

    def usage(self) -> dict[str, tuple[int, int, int]]:
        """Per pool: (held by live sequences, cached, free). Cached: blocks no sequence holds,
        and whatever only ended sequences hold; the three add up to the pool's capacity."""
        ended = list(self.ended.values())
        return {name: kind.usage(ended) for name, kind in self.kinds.items()}

    def check(self, live: list[Sequence]) -> None:
        """Every invariant, against the live sequences: each is held (its status), swapped out
        exactly when it has a host copy, and holding nothing when swapped out or preempted;
        each kept sequence is kept; each page's count is the number of sequences (live or
        ended) holding it, no page or slot is held twice or lost."""
        for s in live:
            assert s.status in HELD, f"sequence {s.seq_id} is {s.status.value}, not held"
            assert (s.status is SequenceStatus.SWAPPED) == (s.swapped is not None), \
                f"sequence {s.seq_id} is {s.status.value} with a host copy: {s.swapped}"
            if s.status in (SequenceStatus.SWAPPED, SequenceStatus.PREEMPTED):
                assert not any(s.holding.values()), f"sequence {s.seq_id} is {s.status.value}"
        for s in self.ended.values():
            assert s.status is SequenceStatus.KEPT, f"ended {s.seq_id} is {s.status.value}"
        ended = list(self.ended.values())
        holders = [*live, *ended]
        for s in holders:
            assert len(s.block_hashes) <= s.num_cached // self.block_size
        for kind in self.kinds.values():
            kind.check(holders, ended)

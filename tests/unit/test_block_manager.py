"""pages.BlockManager over page_pools.SharedPagePool: eviction order, counts, chained hashes,
continued turns, rollback, rings, state slots; then random operations checked against a shadow of
what every page holds. A "call" is the engine's: start(), reserve(), token_ids set (admit), then
num_cached advanced and register() (Engine._call)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from triton_tlaloc import pages
from triton_tlaloc.pages import (FULL, STATE, WINDOWED, BlockManager, PagesExhausted, PoolShape,
                                 SharedPagePool, root_hash)
from triton_tlaloc.kv.sequence import Sequence

BS = 4
ROOT = root_hash("model")


def manager(num_blocks: int = 16, keep_ended: int = 4) -> BlockManager:
    return BlockManager(PoolShape(num_blocks, BS), prefix_reuse=True, keep_ended=keep_ended)


def run(blocks: BlockManager, prompt: list[int], root: bytes = ROOT):
    """A START whose call computes the whole prompt: the new sequence and what it reused."""
    seq = Sequence([])
    reuse = blocks.start(seq, prompt, root)
    blocks.reserve(seq, len(prompt))
    seq.token_ids, seq.num_cached = list(prompt), len(prompt)
    blocks.register(seq)
    return seq, reuse


def pool_state(blocks: BlockManager) -> tuple:
    full = blocks.full
    return (tuple(full.refs), tuple(full.block_of(p) for p in range(full.num_blocks)),
            full.cached, full.free, tuple(blocks.ended), blocks.dropped)


def h(n: int) -> bytes:  # a block hash
    return n.to_bytes(16, "little")


def test_pool_evicts_uncached_pages_first_then_least_recently_released_deepest_first():
    pool = SharedPagePool(8)  # pages 1..7
    a, b = pool.allocate(3), pool.allocate(2)
    assert (a, b) == ([1, 2, 3], [4, 5])
    for p in a + b:
        pool.register(p, h(p))
    pool.release(a)  # last page first: cached 3, 2, 1
    pool.release(b)  # then 5, 4
    assert pool.allocate(2) == [6, 7] and pool.evicted == 0  # uncached before cached
    assert pool.allocate(2) == [3, 2] and pool.evicted == 2  # a's deepest blocks first
    assert pool.block_of(3) is None and pool.lookup([h(1), h(2)]) == [1]  # their blocks forgotten
    pool.share([5])
    pool.release([5])  # touched: now the most recently released
    assert pool.allocate(3) == [1, 4, 5]
    pool.check()


def test_a_shared_page_is_counted_per_holder_and_never_handed_out():
    pool = SharedPagePool(4)  # pages 1..3
    [p] = pool.allocate(1)
    pool.register(p, h(1))
    pool.share([p])
    assert pool.refs[p] == 2
    pool.release([p])
    assert pool.refs[p] == 1 and pool.cached == 0  # still held: not evictable
    assert p not in pool.allocate(2)
    with pytest.raises(PagesExhausted, match="1 pages needed, 0 free of 3"):
        pool.allocate(1)
    pool.release([p])
    assert pool.cached == 1 and pool.lookup([h(1), h(2)]) == [p]
    pool.share([p, p])
    assert pool.cached == 0 and pool.refs[p] == 2
    with pytest.raises(AssertionError, match="is shared"):
        pool.unregister(p)  # a holder may not overwrite a block another holder reads
    pool.check()
    pool._uncached.append(p)  # check() is not vacuous: a held page on the free list
    with pytest.raises(AssertionError, match="free and held"):
        pool.check()


def test_prompts_of_different_roots_share_no_block():
    prompt = list(range(1, 13))
    blocks = manager()
    a, _ = run(blocks, prompt, root_hash("model", "alice"))
    b, reuse = run(blocks, prompt, root_hash("model", "bob"))
    assert reuse.reused == 0 and not set(a.pages) & set(b.pages)
    m2, reuse = run(blocks, prompt, root_hash("model-2", "alice"))
    assert reuse.reused == 0
    c, reuse = run(blocks, prompt, root_hash("model", "alice"))
    assert reuse.reused == 8 and c.pages[:2] == a.pages[:2]  # the control: same root shares
    assert blocks.full.refs[a.pages[0]] == 2
    blocks.check([a, b, c, m2])


def test_a_fully_cached_prompt_still_computes_its_last_block():
    """Its last token's logits are the answer: a prompt of exactly two cached blocks reuses one."""
    blocks = manager(keep_ended=0)
    a, _ = run(blocks, list(range(8)))
    assert len(a.block_hashes) == 2
    first = a.pages[0]
    blocks.free(a)
    seq = Sequence([])
    reuse = blocks.start(seq, list(range(8)), ROOT)
    assert reuse.reused == 4 and seq.pages == [first] and blocks.need(seq, 8) == {FULL: 1}
    blocks.unstart(seq, reuse)
    _, reuse = run(blocks, list(range(9)))
    assert reuse.reused == 8


def test_block_hashes_chain_their_parent(monkeypatch):
    """Block 1's KV depends on block 0: a hash of its own tokens alone would serve C's KV computed
    after A to a prompt B + C (the negative control shows that collision happens)."""
    a, b, c, d = ([k] * BS for k in (1, 2, 3, 4))

    def scenario():
        blocks = manager()
        p1, _ = run(blocks, a + c + [9])
        p2, _ = run(blocks, b + d + [9])
        p3, reuse = run(blocks, b + c + [9])
        blocks.check([p1, p2, p3])
        return p1, p2, p3, reuse

    p1, p2, p3, reuse = scenario()
    assert reuse.reused == 4 and p3.pages[0] == p2.pages[0] and p3.pages[1] not in p1.pages
    chained = pages.block_hash
    monkeypatch.setattr(pages, "block_hash", lambda parent, tokens: chained(ROOT, tokens))
    p1, p2, p3, reuse = scenario()
    assert reuse.reused == 8 and p3.pages[1] == p1.pages[1]  # the wrong KV, shared


def test_a_refused_prompt_leaves_the_pools_as_they_were():
    blocks = manager(num_blocks=9)  # 8 pages
    a, _ = run(blocks, list(range(10)))
    blocks.free(a)  # two blocks cached
    before = pool_state(blocks)
    seq = Sequence([])  # a prompt of two cached blocks and 30 tokens more
    reuse = blocks.start(seq, list(range(8)) + [50] * 30, ROOT)
    assert reuse.reused == 8 and blocks.full.cached == 0  # shared: out of the cache
    with pytest.raises(PagesExhausted, match="8 pages needed, 6 free of 8"):
        blocks.reserve(seq, 38)
    blocks.unstart(seq, reuse)
    assert pool_state(blocks) == before and (seq.pages, seq.num_cached) == ([], 0)

    e, _ = run(blocks, list(range(10)))
    held = list(e.pages)
    blocks.finish(e)
    before = pool_state(blocks)
    seq = Sequence([])
    reuse = blocks.start(seq, list(range(10)) + [50] * 30, ROOT)
    assert reuse.taken is e and not blocks.ended and seq.pages == held
    with pytest.raises(PagesExhausted):
        blocks.reserve(seq, 40)
    blocks.unstart(seq, reuse)
    assert pool_state(blocks) == before and e.pages == held and seq.pages == []
    blocks.check([])


def test_an_ended_sequence_is_continued_only_by_a_prompt_that_extends_its_whole_history():
    history = list(range(1, 11))
    blocks = manager()
    e, _ = run(blocks, history)
    held = list(e.pages)
    blocks.finish(e)

    def attempt(prompt, root=ROOT):
        seq = Sequence([])
        reuse = blocks.start(seq, prompt, root)
        blocks.unstart(seq, reuse)
        return reuse

    assert attempt(history + [11]).taken is e
    late, early = list(history), list(history)
    late[9], early[0] = 99, 99
    for prompt, reused in ((late + [11], 8), (early + [11], 0)):  # up to the first difference
        assert (attempt(prompt).taken, attempt(prompt).reused) == (None, reused)
    assert attempt(history).taken is None  # nothing past it to compute
    assert attempt(history[:6]).taken is None
    assert attempt(history + [11], root_hash("model", "other")).taken is None
    assert list(blocks.ended.values()) == [e]
    seq, reuse = run(blocks, history + [11, 12])
    assert reuse.taken is e and reuse.reused == 10 and seq.pages == held
    assert not blocks.ended and blocks.continued == 1 and len(seq.block_hashes) == 3
    blocks.check([seq])


def test_rollback_forgets_the_blocks_the_sequence_will_write_over():
    blocks = manager()
    seq, _ = run(blocks, list(range(6)))  # block 0 registered, block 1 half computed
    kept = list(seq.pages)
    blocks.reserve(seq, 14)  # a next turn of 8 tokens
    seq.token_ids += list(range(100, 108))
    seq.num_cached = 12  # its first chunk computed, then the call failed
    blocks.register(seq)
    assert len(seq.block_hashes) == 3
    h1, h2, third = seq.block_hashes[1], seq.block_hashes[2], seq.pages[2]
    assert blocks.rollback(seq, 6, 2)
    assert (seq.pages, seq.num_cached, len(seq.token_ids), len(seq.block_hashes)) == \
        (kept, 6, 6, 1)
    assert blocks.full.block_of(kept[1]) is None  # the next turn writes positions 6..7 again
    assert blocks.full.block_of(third) == h2 and blocks.full.refs[third] == 0  # its KV is right
    assert blocks.full.lookup([seq.block_hashes[0], h1]) == kept[:1]
    blocks.check_writes(seq)
    blocks.check([seq])


def test_finish_keeps_the_latest_keep_ended_sequences_and_frees_the_rest():
    blocks = manager(keep_ended=2)
    seqs = [run(blocks, [k] * 6)[0] for k in range(3)]
    first = list(seqs[0].pages)
    for s in seqs:
        blocks.finish(s)
    assert list(blocks.ended.values()) == seqs[1:] and blocks.dropped == 1
    assert blocks.full.refs[first[0]] == 0 and blocks.full.block_of(first[0]) is not None
    assert blocks.usage()[FULL] == (0, 5, 10)  # 4 pages kept whole, 1 block cached
    blocks.finish(Sequence([]))  # nothing computed: nothing to continue, not kept
    assert len(blocks.ended) == 2
    blocks.check([])


def test_ended_sequences_are_dropped_least_recent_first_before_a_prompt_is_refused():
    blocks = manager(num_blocks=9, keep_ended=8)  # 8 pages
    a, _ = run(blocks, [1] * 10)
    b, _ = run(blocks, [2] * 10)
    for s in (a, b):
        blocks.finish(s)
    c, _ = run(blocks, [3] * 14)  # 4 pages: 2 free, then a dropped
    assert list(blocks.ended.values()) == [b] and blocks.dropped == 1
    seq = Sequence([])
    reuse = blocks.start(seq, [4] * 40, ROOT)
    with pytest.raises(PagesExhausted, match="10 pages needed, 1 free of 8"):
        blocks.reserve(seq, 40)
    blocks.unstart(seq, reuse)
    # b is kept: dropping it (3 pages) could not have made room for 10
    assert list(blocks.ended.values()) == [b] and blocks.dropped == 1
    blocks.check([c])
    seq = Sequence([])
    blocks.start(seq, [5] * 16, ROOT)
    blocks.reserve(seq, 16)  # 4 pages: 1 free, and b's 3 once it is dropped
    assert not blocks.ended and blocks.dropped == 2
    blocks.check([c, seq])


@pytest.mark.parametrize("shape, pool", [
    (PoolShape(16, BS, ring_blocks=9, ring_pages=2), WINDOWED),
    (PoolShape(16, BS, state_slots=2), STATE),
])
def test_rings_and_state_slots_turn_prefix_reuse_off_but_ended_sequences_continue(shape, pool):
    blocks = BlockManager(shape, prefix_reuse=True, keep_ended=4)
    assert not blocks.prefix_reuse
    a, _ = run(blocks, list(range(10)))
    assert a.block_hashes == []
    held = (list(a.pages), list(a.ring), a.state_slot)
    blocks.finish(a)
    assert blocks.usage()[pool] == ((0, 2, 6) if pool == WINDOWED else (0, 1, 1))
    b, reuse = run(blocks, list(range(8)) + [99] * 3)  # two equal blocks: not shared
    assert reuse.reused == 0 and not set(b.pages) & set(held[0])
    c, reuse = run(blocks, list(range(12)))
    assert reuse.taken is a and reuse.reused == 10
    assert (c.pages, c.ring, c.state_slot) == held and blocks.need(c, 12)[pool] == 0
    blocks.check([b, c])


# ---------------------------------------------------------------- random operations

PIECES = [[1] * BS, [2] * BS, [1, 2, 3, 4]]  # prompts are made of these: prefixes recur
ROOTS = (root_hash("model"), root_hash("model", "tenant"))
MAX_LEN = 36


def kv_keys(seq: Sequence, end: int) -> list[int]:
    """What the KV at each position depends on: the root and every token up to it."""
    key, keys = hash(seq.root), []
    for t in seq.token_ids[:end]:
        key = hash((key, t))
        keys.append(key)
    return keys


class Simulation:
    """A block manager over a small pool, a shadow of what every page holds, and the sequences."""

    def __init__(self, seed: int, num_blocks: int = 20):
        self.rng = random.Random(seed)
        self.blocks = BlockManager(PoolShape(num_blocks, BS), keep_ended=3)
        self.live: list[Sequence] = []
        self.kv: dict[int, list] = {}  # page -> what each of its slots holds
        self.seen = Counter()

    def tokens(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            out += self.rng.choice(PIECES + [[self.rng.randint(5, 9)]])
        return out[:n]

    def call(self, seq: Sequence, end: int) -> bool:
        """The device calls computing positions num_cached..end-1 in chunks; False when one
        failed (after writing part of its chunk)."""
        keys, full = kv_keys(seq, end), self.blocks.full
        while seq.num_cached < end:
            self.blocks.check_writes(seq)
            stop = min(end, seq.num_cached + self.rng.randint(1, 3 * BS))
            failed = self.rng.random() < 0.03
            for pos in range(seq.num_cached, stop):
                page = seq.pages[pos // BS]
                assert full.refs[page] == 1 and full.block_of(page) is None, "writes a shared block"
                self.kv.setdefault(page, [None] * BS)[pos % BS] = "junk" if failed else keys[pos]
            if failed:
                return False
            seq.num_cached = stop
            self.blocks.register(seq)
        return True

    def start(self, prompt: list[int], root: bytes):
        blocks, seq = self.blocks, Sequence([])
        before = pool_state(blocks)
        reuse = blocks.start(seq, prompt, root)
        assert reuse.reused == seq.num_cached < len(prompt)
        try:
            blocks.reserve(seq, len(prompt))
        except PagesExhausted:
            blocks.unstart(seq, reuse)
            assert (seq.pages, seq.num_cached, seq.block_hashes) == ([], 0, [])
            if blocks.dropped == before[-1]:
                assert pool_state(blocks) == before
            self.seen["refused"] += 1
            return reuse
        seq.token_ids = list(prompt)
        self.seen["continued" if reuse.continued else "prefix" if reuse.reused else "cold"] += 1
        if not self.call(seq, len(prompt)):  # a failed START: rolled back, then freed
            assert blocks.rollback(seq, 0, 0) and seq.pages == []
            blocks.free(seq)
            self.seen["rolled back"] += 1
            return reuse
        self.live.append(seq)
        return reuse

    def extend(self, seq: Sequence, n: int) -> None:
        """A decode step (n = 1) or a next turn on a live sequence."""
        num_tokens, kept = len(seq.token_ids), list(seq.pages)
        try:
            self.blocks.reserve(seq, num_tokens + n)
        except PagesExhausted:
            assert seq.pages == kept, "a refused reservation took pages"
            return
        seq.token_ids += self.tokens(n)
        if not self.call(seq, len(seq.token_ids)):
            assert self.blocks.rollback(seq, num_tokens, len(kept))
            assert (len(seq.token_ids), seq.num_cached, seq.pages) == (num_tokens, num_tokens, kept)
            self.seen["rolled back"] += 1

    def step(self) -> Sequence | None:
        """One random operation; the live sequence it grew or rolled back, if any."""
        rng, blocks, live = self.rng, self.blocks, self.live
        growable = [s for s in live if len(s.token_ids) < MAX_LEN]
        op = rng.choices(["start", "continue", "decode", "turn", "free", "finish", "outsider"],
                         [4 if len(live) < 5 else 0, 2 if blocks.ended else 0,
                          6 if growable else 0, 2 if growable else 0,
                          1 if live else 0, 2 if live else 0, 1])[0]
        if op == "start":
            self.start(self.tokens(rng.randint(1, 5 * BS)), rng.choice(ROOTS))
        elif op == "continue":
            e = rng.choice(list(blocks.ended.values()))
            prompt = e.token_ids + self.tokens(rng.randint(1, 6))
            changed = rng.random() < 0.3
            if changed:
                prompt[rng.randrange(e.num_cached)] += 100  # one history token differs
            reuse = self.start(prompt, e.root)
            assert reuse.taken is not e if changed else reuse.reused >= e.num_cached
            self.seen["not continued"] += changed
        elif op in ("decode", "turn"):
            seq = rng.choice(growable)
            self.extend(seq, 1 if op == "decode" else rng.randint(2, 2 * BS))
            return seq
        elif op in ("free", "finish"):
            seq = live.pop(rng.randrange(len(live)))
            (blocks.free if op == "free" else blocks.finish)(seq)
        else:  # another sequence takes pages and writes into them: cached blocks are evicted
            got = blocks.full.allocate(min(rng.randint(1, 6), blocks.full.free))
            self.kv.update((p, ["outsider"] * BS) for p in got)
            blocks.full.release(got)
        return None

    def check(self, before: dict[int, list[int]], grown: Sequence | None) -> None:
        blocks, full = self.blocks, self.blocks.full
        blocks.check(self.live)
        holders = self.live + list(blocks.ended.values())
        counts = Counter(p for s in holders for p in s.pages)
        for s in holders:
            old = before.get(id(s))
            if old is not None:
                n = min(len(old), len(s.pages))
                assert s.pages == old or (s is grown and s.pages[:n] == old[:n]), \
                    f"sequence {s.seq_id}: pages changed by another's operation"
            for pos, key in enumerate(kv_keys(s, s.num_cached)):
                assert self.kv[s.pages[pos // BS]][pos % BS] == key, \
                    f"sequence {s.seq_id}: position {pos} holds another prefix's KV"
            for b, p in enumerate(s.pages):
                if b < len(s.block_hashes):
                    assert full.block_of(p) in (None, s.block_hashes[b])
                if counts[p] > 1:  # shared: a registered full block both hold, neither writes
                    assert b < len(s.block_hashes) and full.block_of(p) == s.block_hashes[b]
                    self.seen["shared"] += 1
        held, cached, free = blocks.usage()[FULL]
        assert min(held, cached, free) >= 0 and held + cached + free == full.capacity
        assert held == len({p for s in self.live for p in s.pages})


def simulate(seed: int, steps: int) -> Simulation:
    sim = Simulation(seed)
    for _ in range(steps):
        before = {id(s): list(s.pages) for s in sim.live + list(sim.blocks.ended.values())}
        sim.check(before, sim.step())
    return sim


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_every_sequence_on_its_own_kv(seed):
    """Whatever the order of prompts, turns, decodes, failed calls, ends and evictions, every
    position a sequence (live or kept) counts as computed holds the KV of its own prefix."""
    sim = simulate(seed, 5000)
    seen = sim.seen | Counter(evicted=sim.blocks.full.evicted, dropped=sim.blocks.dropped)
    for what in ("prefix", "continued", "not continued", "cold", "shared", "refused",
                 "rolled back", "evicted", "dropped"):
        assert seen[what] > 0, f"seed {seed}: no {what} in {dict(seen)}"


def test_the_random_check_catches_hashes_that_ignore_their_parent(monkeypatch):
    """The negative control of the shadow check: block hashes of a block's own tokens only."""
    chained = pages.block_hash
    monkeypatch.setattr(pages, "block_hash", lambda parent, tokens: chained(b"", tokens))
    with pytest.raises(AssertionError, match="another prefix's KV|holds a page twice"):
        simulate(0, 3000)

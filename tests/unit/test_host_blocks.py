"""The host tier as a second level of the prefix cache, over a fake runtime whose "KV" is the
token at each slot: cached blocks the device pool evicts are copied to the host, a prompt whose
prefix continues into them gets them written into its new pages (holding the right tokens, in
the right order) instead of computing them, within what the budget leaves after swapped-out
sequences."""

from __future__ import annotations

import pytest
from checks.fakes import FakeRuntime, FakeTransfer, fake_artifact

from triton_tlaloc.engine.core import Engine, Sequence
from triton_tlaloc.kv.host_tier import HostTier
from triton_tlaloc.pages import PagesExhausted

BLOCK = 8 * 8  # bytes of one fake page: 8 int64 tokens
SYSTEM = list(range(10, 42))  # 4 full blocks of 8


def setup(num_blocks=9, budget=1 << 30):
    art = fake_artifact(num_blocks=num_blocks)  # num_blocks - 1 usable pages of 8 tokens
    rt = FakeRuntime(art)
    engine = Engine(rt, prefix_reuse=True)
    return rt, engine, HostTier(engine.blocks, FakeTransfer(rt), budget)


def run(engine, tokens):
    seq = Sequence([])
    reuse = engine.admit(seq, list(tokens))
    engine.prefill_chunked(seq)
    return seq, reuse


def evict_all(engine, n_tokens=64, first=100):
    """A prompt of unrelated tokens that takes every page (evicting every cached one)."""
    seq, _ = run(engine, range(first, first + n_tokens))
    engine.free(seq)


def test_evicted_blocks_are_found_on_the_host_and_written_back_instead_of_computed():
    rt, engine, host = setup()
    a, _ = run(engine, SYSTEM + [50])  # 5 pages, 4 full blocks registered
    engine.free(a)  # its 4 blocks stay cached on the device
    evict_all(engine)
    assert host.spilled == 4 and host.cached_bytes == 4 * BLOCK and engine.blocks.full.cached == 8
    c = Sequence([])
    reuse = engine.admit(c, SYSTEM + [60, 61])
    assert reuse.reused == reuse.from_host == 32 and c.num_cached == 32
    assert rt.kv_of(c) == SYSTEM  # written back before the call, in order
    before = len(rt.calls)
    engine.prefill_chunked(c)
    assert rt.kv_of(c) == c.token_ids and len(rt.calls) == before + 1
    assert host.restored == 4
    engine.blocks.check([c])
    # Registered again on the device: the next prompt shares them without the host.
    d = Sequence([])
    reuse = engine.admit(d, SYSTEM + [70])
    assert reuse.reused == 32 and reuse.from_host == 0 and d.pages[:4] == c.pages[:4]


def test_blocks_written_back_in_the_wrong_order_do_not_hold_the_prompt():
    """The negative control of the check above."""
    rt, engine, host = setup()
    a, _ = run(engine, SYSTEM + [50])
    engine.free(a)
    evict_all(engine)
    host.restore = (lambda restore: lambda blocks, pages: restore(blocks[::-1], pages))(
        host.restore)
    c = Sequence([])
    engine.admit(c, SYSTEM + [60])
    assert rt.kv_of(c) != SYSTEM


def test_a_prefix_half_on_the_device_continues_on_the_host():
    rt, engine, host = setup()
    a, _ = run(engine, SYSTEM + [50])
    pages = list(a.pages)
    engine.free(a)  # cached deepest block first: blocks 3 and 2 are evicted before 1 and 0
    b, _ = run(engine, range(100, 148))  # 6 pages: 4 uncached, 2 evicted (a's blocks 3, 2)
    engine.free(b)
    assert host.spilled == 2
    c = Sequence([])
    reuse = engine.admit(c, SYSTEM + [60])
    assert reuse.reused == 32 and reuse.from_host == 16 and c.pages[:2] == pages[:2]
    assert rt.kv_of(c) == SYSTEM
    engine.prefill_chunked(c)
    assert rt.kv_of(c) == c.token_ids
    engine.blocks.check([c])


def test_a_block_already_on_the_host_is_not_copied_again():
    rt, engine, host = setup()
    a, _ = run(engine, SYSTEM + [50])
    engine.free(a)
    evict_all(engine)
    c, _ = run(engine, SYSTEM + [60])  # written back from the host, registered on the device
    engine.free(c)
    spilled, evicted = host.spilled, engine.blocks.full.evicted
    evict_all(engine, first=170)  # evicts them again: their bytes are on the host already
    evicted = engine.blocks.full.evicted - evicted
    assert evicted == 7  # every page but c's last, partial one (never registered)
    assert host.spilled - spilled == evicted - 4


def test_a_refused_reservation_leaves_the_host_blocks_and_the_pools_as_they_were():
    rt, engine, host = setup()
    a, _ = run(engine, SYSTEM + [50])
    engine.free(a)
    hog, _ = run(engine, range(100, 164))  # holds all 8 pages (a's evicted to the host)
    c = Sequence([])
    with pytest.raises(PagesExhausted):
        engine.admit(c, SYSTEM + [60])
    assert c.pages == [] and c.from_host == [] and c.num_cached == 0 and not c.token_ids
    assert host.restored == 0 and len(host.cached) == 4
    engine.blocks.check([hog])
    engine.free(hog)
    reuse = engine.admit(c, SYSTEM + [60])
    assert reuse.from_host == 32 and rt.kv_of(c) == SYSTEM


def test_evicted_blocks_live_in_what_swapped_out_sequences_leave_of_the_budget():
    rt, engine, host = setup(num_blocks=17, budget=6 * BLOCK)  # 16 pages, 6 on the host
    a, _ = run(engine, SYSTEM + [50])
    engine.free(a)
    evict_all(engine, 128)  # 16 pages: evicts a's 4 blocks
    assert len(host.cached) == 4 and host.cached_bytes == 4 * BLOCK
    # 3 pages: evicts 3 of the filler's cached blocks, spilled too; of the 7 that do not fit
    # in 6, a's deepest (the least recently spilled) goes.
    s, _ = run(engine, range(200, 220))
    assert host.spilled == 7 and len(host.cached) == 6
    host.swap_out(s)  # needs 3 of the 6: a's three other blocks go
    assert host.used == 3 * BLOCK and len(host.cached) == 3
    assert host.used + host.cached_bytes <= host.budget
    c = Sequence([])
    reuse = engine.admit(c, SYSTEM + [60])
    assert reuse.reused == reuse.from_host == 0  # a's blocks are on neither tier now
    host.swap_in(s)
    assert rt.kv_of(s) == s.token_ids and host.used == 0


def test_models_without_prefix_reuse_spill_nothing():
    art = fake_artifact(num_blocks=9)
    rt = FakeRuntime(art)
    engine = Engine(rt, prefix_reuse=False)
    host = HostTier(engine.blocks, FakeTransfer(rt), 1 << 30)
    assert engine.blocks.spill is None
    a, _ = run(engine, SYSTEM + [50])
    engine.free(a)
    evict_all(engine)
    assert host.spilled == 0 and not host.cached

"""Blockwise attention against the one-pass form at the edges listed in
docs/design.md#paged-attention; every form's output unchanged, bit for bit, when each position a
row does not hold is NaN (what an earlier sequence may leave in a page), with the control: the
values masked by the softmax weights alone come out NaN."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from triton_tlaloc.export import attention
from triton_tlaloc.export.attention import (blockwise, by_length, one_pass, ring,
                                            usable_key_blocks)

# Pages of 4 positions, key blocks of 8 (2 pages), a context of 32 (4 key blocks).
BLOCK, KEY_BLOCK, PAGES_PER_ROW = 4, 8, 8
KH, G, D = 2, 2, 8
# f32, the same products summed in another order: stated tolerance on |difference|.
TOL = 1e-5


def setup(rows, t=3, seed=0):
    """rows: per row (seq_len, first position of its t tokens) or None for a padding row."""
    rng = np.random.default_rng(seed)
    pages = 1 + len(rows) * PAGES_PER_ROW
    k_pool = rng.standard_normal((pages, BLOCK, KH, D)).astype(np.float32)
    v_pool = rng.standard_normal((pages, BLOCK, KH, D)).astype(np.float32)
    q = rng.standard_normal((len(rows), t, KH, G, D)).astype(np.float32) * 2
    tables = np.zeros((len(rows), PAGES_PER_ROW), np.int32)
    positions = np.zeros((len(rows), t), np.int32)
    lens = np.zeros((len(rows),), np.int32)
    perm = rng.permutation(np.arange(1, pages))
    for r, row in enumerate(rows):
        tables[r] = perm[r * PAGES_PER_ROW:(r + 1) * PAGES_PER_ROW]
        if row is not None:
            lens[r], first = row
            positions[r] = np.clip(np.arange(first, first + t), 0, None)
    return q, k_pool, v_pool, tables, positions, lens


def both(args, window=None):
    one = jax.jit(one_pass, static_argnums=6)(*args, window)
    blk = jax.jit(blockwise, static_argnums=(6, 7))(*args, KEY_BLOCK, window)
    return np.asarray(one), np.asarray(blk)


CASES = {
    "at a block boundary": [(8, 5)],
    "one past a block boundary": [(9, 6)],
    "two blocks and one past": [(17, 14)],
    "the whole context": [(32, 29)],
    "length 1": [(1, 0)],
    "length 0 (comes out 0)": [(0, 0)],
    "blocks fully masked for some rows": [(32, 29), (3, 0), (9, 6)],
    "a padding row beside a live one": [(20, 17), None],
}


@pytest.mark.parametrize("rows", CASES.values(), ids=CASES.keys())
def test_blockwise_equals_one_pass(rows):
    one, blk = both(setup(rows))
    assert np.max(np.abs(one - blk)) <= TOL
    for r, row in enumerate(rows):
        if row is None or row[0] == 0:
            assert not blk[r].any(), "a row that sees nothing comes out 0"


DECODE_CASES = {
    "at a block boundary": [(8, 7)],
    "one past a block boundary": [(9, 8)],
    "the whole context": [(32, 31)],
    "length 1": [(1, 0)],
    "rows in different blocks, and a padding row": [(32, 31), (3, 2), None, (17, 16)],
}


@pytest.mark.parametrize("rows", DECODE_CASES.values(), ids=DECODE_CASES.keys())
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window 8"])
def test_one_token_a_row_blockwise_equals_one_pass(rows, window):
    """Decode: one token a row, each at its row's last position."""
    one, blk = both(setup(rows, t=1), window)
    assert np.max(np.abs(one - blk)) <= TOL
    for r, row in enumerate(rows):
        if row is None:
            assert not blk[r].any(), "a padding row comes out 0"


def test_a_context_uses_the_blocks_it_holds_more_than_two_of():
    assert usable_key_blocks((256, 1024), 512) == (256,)
    assert usable_key_blocks((256, 1024), 2048) == (256,)
    assert usable_key_blocks((256, 1024), 8192) == (256, 1024)
    assert usable_key_blocks((4, 8, 16), 32) == (4, 8)


# (rows, tokens a row): the three-token cases and the one-token (decode) cases
ALL_CASES = {**{k: (v, 3) for k, v in CASES.items()},
             **{f"one token, {k}": (v, 1) for k, v in DECODE_CASES.items()}}


@pytest.mark.parametrize("rows,t", ALL_CASES.values(), ids=ALL_CASES.keys())
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window 8"])
def test_key_blocks_chosen_by_length_equal_one_pass(rows, t, window):
    """Key blocks of 4, or of 8 when the call holds more than 16 positions: calls on either
    side of the switch, with and without a window."""
    args = setup(rows, t=t)
    one = np.asarray(jax.jit(one_pass, static_argnums=6)(*args, window))
    got = np.asarray(jax.jit(by_length, static_argnums=(6, 7))(*args, (4, 8), window))
    assert np.max(np.abs(one - got)) <= TOL


def gathered(monkeypatch, fn):
    """`fn` compiled with a callback in `attention._gather` (patched while the test runs) that
    records the pages each gather of a call reads (row 0's): a loop's iterations each once, of
    a `by_length` call only the branch it chose. Returns a function that runs the compiled
    call and returns what its gathers read, sorted."""
    read = []
    gather = attention._gather

    def spy(k_pool, v_pool, tables):
        jax.debug.callback(lambda t: read.append(np.asarray(t)[0].tolist()), tables)
        return gather(k_pool, v_pool, tables)

    monkeypatch.setattr(attention, "_gather", spy)
    call = jax.jit(lambda *a: fn(*a))  # a new function: traced with the spy

    def run(*args):
        read.clear()
        jax.block_until_ready(call(*args))
        return sorted(read)
    return run


def test_the_block_follows_the_length(monkeypatch):
    """Which block a call ran, told by the pages it gathered: a call holding 10 positions
    (blocks of 4) reads pages 0..2 one at a time, never page 3 (positions 12..15, which a
    block of 8 reads); a call holding 17 (more than two blocks of 8) reads pages 0..5 two at a
    time, where blocks of 4 would stop at page 4."""
    run = gathered(monkeypatch, lambda *a: by_length(*a, (4, 8)))

    def pages(held):
        q, k, v, tables, positions, _ = setup([(held, held - 3)])
        return run(q, k, v, tables, positions, np.array([held], np.int32)), tables[0].tolist()

    read, table = pages(10)
    assert read == sorted([[p] for p in table[:3]])
    read, table = pages(17)
    assert read == sorted([table[i:i + 2] for i in range(0, 6, 2)])


@pytest.mark.parametrize("t", [1, 3])
def test_a_context_that_is_not_whole_key_blocks(t):
    """Key blocks of 12 positions (3 pages) over a context of 32: the last block is 2 pages
    short; its missing pages lie past the context and are masked."""
    args = setup([(32, 32 - t), (25, 25 - t), (11, 11 - t)], t=t)
    one = np.asarray(jax.jit(one_pass)(*args))
    blk = np.asarray(jax.jit(blockwise, static_argnums=6)(*args, 12))
    assert np.max(np.abs(one - blk)) <= TOL


WINDOW_CASES = {
    "window starts crossing a block boundary inside one call": ([(18, 14)], 4),
    "window inside one block": ([(30, 27)], 3),
    "window, rows far apart": ([(30, 27), (5, 2)], 3),
    "window wider than the row": ([(4, 1)], 3),
}


@pytest.mark.parametrize("rows,t", WINDOW_CASES.values(), ids=WINDOW_CASES.keys())
def test_blockwise_equals_one_pass_with_a_window(rows, t):
    one, blk = both(setup(rows, t=t), window=8)
    assert np.max(np.abs(one - blk)) <= TOL
    full, _ = both(setup(rows, t=t))
    assert np.max(np.abs(one - full)) > 100 * TOL or rows[0][0] <= 8, \
        "the window changes the result where a row is longer than it"


def test_a_call_with_no_live_position_comes_out_0():
    one, blk = both(setup([None, None]))
    assert not one.any() and not blk.any()


def test_tolerance_tells_a_missing_block():
    """Negative control: one key block fewer (the last block dropped) fails the tolerance."""
    q, k, v, tables, positions, lens = setup([(17, 14)])
    full = np.asarray(jax.jit(blockwise, static_argnums=6)(q, k, v, tables, positions, lens,
                                                             KEY_BLOCK))
    short = np.asarray(jax.jit(one_pass)(q, k, v, tables, np.minimum(positions, 15),
                                         np.minimum(lens, 16)))
    assert np.max(np.abs(full[:, -1] - short[:, -1])) > 100 * TOL


def test_the_loop_stops_at_the_last_live_block(monkeypatch):
    """A call early in a large bucket gathers only the blocks its rows reach: a row of 6
    positions reads its first key block (2 pages) and no other; the control, a row of 9,
    reads two."""
    run = gathered(monkeypatch, lambda *a: blockwise(*a, KEY_BLOCK))
    q, k, v, tables, positions, lens = setup([(6, 3)])
    assert run(q, k, v, tables, positions, lens) == [tables[0, :2].tolist()]
    assert run(q, k, v, tables, positions + 3, lens + 3) == sorted(
        [tables[0, :2].tolist(), tables[0, 2:4].tolist()])


# ------------------------------------------------------------------ stale pages

def stale_nan(pools, tables, lens, held=None):
    """The pools with NaN at every position no row holds: past each row's length in its pages,
    every page of a padding row, page 0 (what an earlier sequence whose KV was NaN may leave in
    the pages a new one takes). `held` [b, table positions]: which positions each row holds
    (default: those below its length)."""
    out = [p.copy() for p in pools]
    if held is None:
        held = np.arange(tables.shape[1] * BLOCK)[None, :] < lens[:, None]
    keep = np.zeros(out[0].shape[:2], bool)  # [pages, offset]
    for r in range(len(tables)):
        for j, page in enumerate(tables[r]):
            keep[page] |= held[r, j * BLOCK:(j + 1) * BLOCK]
    for p in out:
        p[~keep] = np.nan
    return out


def multiplied(values, held):
    """The values as the softmax weights alone masked them: a masked key's zero weight times
    its page's old value (NaN times 0 is NaN)."""
    return values.astype(np.float32)


# Cases of the tests above (their compiles are shared): rows ending mid-page beside a full
# one; decode rows ending mid-page beside a padding row, with a window.
# The control runs one form a case: one pass for the prompt rows, blockwise for the decode rows.
STALE_CASES = {
    "prompt rows": (CASES["blocks fully masked for some rows"], 3, None, "one pass"),
    "decode rows and a padding row, window 8": (
        DECODE_CASES["rows in different blocks, and a padding row"], 1, 8, "blockwise"),
}


@pytest.mark.parametrize("rows,t,window,control", STALE_CASES.values(), ids=STALE_CASES.keys())
def test_nan_where_a_row_holds_nothing_changes_no_output(rows, t, window, control, monkeypatch):
    q, k, v, tables, positions, lens = setup(rows, t=t)
    nan_k, nan_v = stale_nan((k, v), tables, lens)
    assert all(np.isnan(nan_v[tables[r]]).any() for r in range(len(rows)) if lens[r] < 32)
    clean = both((q, k, v, tables, positions, lens), window)
    got = both((q, nan_k, nan_v, tables, positions, lens), window)
    for name, c, g in zip(("one pass", "blockwise"), clean, got):
        assert np.array_equal(c, g), name
        assert not any(g[r].any() for r, row in enumerate(rows) if row is None), name
    # control: the values masked by the weights alone let the NaN through to every live row
    # that does not hold its whole table
    monkeypatch.setattr(attention, "held_values", multiplied)
    form = {"one pass": lambda *a: one_pass(*a, window),
            "blockwise": lambda *a: blockwise(*a, KEY_BLOCK, window)}[control]
    got = np.asarray(jax.jit(form)(q, nan_k, nan_v, tables, positions, lens))
    assert all(np.isnan(got[r]).any() for r, row in enumerate(rows)
               if row is not None and row[0] < 32), f"{control}: the control held"


def test_nan_in_ring_slots_not_written_yet_changes_no_output(monkeypatch):
    """A ring of 4 pages (period 16, window 8): rows whose ring is not full yet (lengths 3
    and 10: slots from their length on hold a page's old contents, NaN here) beside a row
    that has wrapped (length 21) and a padding row; the same outputs, and the control comes
    out NaN."""
    rows = [(3, 0), (10, 7), (21, 18), None]
    period, window = 4 * BLOCK, 8
    q, k, v, tables, positions, lens = setup(rows, t=3)
    tables = tables[:, :4]
    last = (lens - 1)[:, None]
    slot = np.arange(period)[None, :]
    written = ((last - np.mod(last - slot, period)) >= 0) & (lens > 0)[:, None]
    nan_k, nan_v = stale_nan((k, v), tables, lens, held=written)
    assert np.isnan(nan_v[tables[0]]).any() and np.isnan(nan_v[tables[1]]).any()

    def form(*a):
        return ring(*a, window, period)
    clean = np.asarray(jax.jit(form)(q, k, v, tables, positions, lens))
    got = np.asarray(jax.jit(form)(q, nan_k, nan_v, tables, positions, lens))
    assert np.array_equal(clean, got) and not got[3].any()
    monkeypatch.setattr(attention, "held_values", multiplied)
    got = np.asarray(jax.jit(lambda *a: form(*a))(q, nan_k, nan_v, tables, positions, lens))
    assert np.isnan(got[0]).any() and np.isnan(got[1]).any()

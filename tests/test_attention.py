"""Blockwise attention against the one-pass form at the edges listed in
docs/design.md#paged-attention."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from triton_tlaloc.export.attention import blockwise, by_length, one_pass, usable_key_blocks

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


def test_the_block_follows_the_length():
    """Which block a call ran, told by NaN keys a block of 8 reads and a block of 4 does not:
    at positions 12..15, a call holding 10 positions (blocks of 4: it reads up to 11) comes
    out finite; at positions 20..23, a call holding 17 (more than two blocks of 8: it reads up
    to 23) comes out NaN, where blocks of 4 would stop at 19."""
    def run(held, nan_page):
        q, k, v, tables, positions, _ = setup([(held, held - 3)])
        k, v = k.copy(), v.copy()
        k[tables[0, nan_page]] = np.nan
        v[tables[0, nan_page]] = np.nan
        lens = np.array([held], np.int32)
        return np.asarray(jax.jit(by_length, static_argnums=6)(q, k, v, tables, positions, lens,
                                                               (4, 8)))

    assert np.isfinite(run(10, 3)).all()
    assert np.isnan(run(17, 5)).any()


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


def test_the_loop_stops_at_the_last_live_block():
    """A call early in a large bucket scores only the blocks its rows reach: with the pages past
    the first block filled with NaN, the result is still finite."""
    q, k, v, tables, positions, lens = setup([(6, 3)])
    k, v = k.copy(), v.copy()
    for page in tables[0, 2:]:  # pages of blocks 1.. (key block = 2 pages)
        k[page] = np.nan
        v[page] = np.nan
    blk = np.asarray(jax.jit(blockwise, static_argnums=6)(q, k, v, tables, positions, lens,
                                                            KEY_BLOCK))
    assert np.isfinite(blk).all()

"""The page pools and the step inputs built from rows: pure Python and numpy."""

from __future__ import annotations

import pytest
from checks.fakes import fake_artifact

from triton_tlaloc.pages import PagePool, PagesExhausted, pages_for
from triton_tlaloc.engine.steps import Row, build_step, row_by_row_inputs


def test_page_pool_never_gives_page_0_and_refuses_by_count():
    pool = PagePool(5)
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and pool.free == 0
    with pytest.raises(PagesExhausted, match="1 pages needed, 0 free of 4"):
        pool.allocate(1)
    pool.release(got[:2])
    assert pool.free == 2 and pool.used == 2
    with pytest.raises(AssertionError):
        pool.release([got[0]])  # released twice
    assert pages_for(16, 16) == 1 and pages_for(17, 16) == 2 and pages_for(0, 16) == 0


def test_build_step_right_aligns_rows_and_pads():
    art = fake_artifact()
    entry = art.entries["prefill_b2_c32"]
    step = build_step(entry, [Row((7, 8, 9), 8, (3, 5))], block_size=8)
    assert step["TOKEN_IDS"][0, -3:].tolist() == [7, 8, 9]
    assert step["TOKEN_IDS"][0, :-3].tolist() == [0] * 29
    assert step["POSITIONS"][0, -3:].tolist() == [8, 9, 10]
    # positions 8..10 are on the second page (5): slots 40, 41, 42; padding -1
    assert step["SLOT_MAPPING"][0, -3:].tolist() == [40, 41, 42]
    assert (step["SLOT_MAPPING"][0, :-3] == -1).all() and (step["SLOT_MAPPING"][1] == -1).all()
    assert step["BLOCK_TABLES"].tolist() == [[3, 5, 0, 0], [0, 0, 0, 0]]
    assert step["SEQ_LENS"].tolist() == [11, 0]
    with pytest.raises(AssertionError, match="do not hold"):
        build_step(entry, [Row((7,), 16, (3, 5))], block_size=8)


def test_one_token_rows_are_built_as_the_row_by_row_path_builds_them():
    """Decode steps are built a column at a time; the inputs equal the row-by-row path's for
    rows at page boundaries, in the middle of pages, short of a full batch. Control: one row a
    position later differs."""
    import numpy as np

    art = fake_artifact()
    entry = next(e for e in art.entries.values() if e.kind == "decode" and e.batch > 1)
    bs = 8
    m = entry.context // bs
    rng = np.random.default_rng(3)
    for n in range(1, entry.batch + 1):
        rows = []
        for _ in range(n):
            start = int(rng.integers(0, entry.context))
            pages = tuple(int(p) for p in rng.choice(np.arange(1, 99), pages_for(start + 1, bs),
                                                      replace=False))
            assert len(pages) <= m
            rows.append(Row((int(rng.integers(0, 256)),), start, pages))
        fast, slow = build_step(entry, rows, bs), row_by_row_inputs(entry, rows, bs)
        assert fast.keys() == slow.keys()
        for k in fast:
            assert fast[k].dtype == slow[k].dtype and np.array_equal(fast[k], slow[k]), k
    rows = [Row((9,), 3, (5,))] + rows[1:]
    moved = [Row((9,), 4, (5,))] + rows[1:]
    assert build_step(entry, rows, bs)["SLOT_MAPPING"][0, 0] == 43
    assert not np.array_equal(build_step(entry, moved, bs)["SLOT_MAPPING"],
                              row_by_row_inputs(entry, rows, bs)["SLOT_MAPPING"])

"""The page pools and the step inputs built from rows: pure Python and numpy."""

from __future__ import annotations

import pytest
from fakes import fake_artifact

from triton_tlaloc.pages import PagePool, PagesExhausted, pages_for
from triton_tlaloc.steps import Row, build_step


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

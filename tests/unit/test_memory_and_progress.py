"""The resident-memory ledger of a load (runtime/memory.py) and the progress lines of `tlaloc
compile` (precompile.Progress), with injected readings and clocks."""

from __future__ import annotations

from triton_tlaloc.runtime.memory import MemoryLedger, release_freed, resident_bytes
from triton_tlaloc.runtime.precompile import Progress

MB = 2**20


def test_the_ledger_gives_each_phase_what_it_added_after_releasing_freed_pages():
    readings = iter([140 * MB, 240 * MB, 780 * MB, 900 * MB])
    released = []
    ledger = MemoryLedger(read=lambda: next(readings), release=lambda: released.append(1))
    assert ledger.mark("2 executables") == 100 * MB
    assert ledger.mark("weights") == 540 * MB
    assert ledger.mark("pools") == 120 * MB
    assert ledger.phases == [("2 executables", 100 * MB), ("weights", 540 * MB),
                             ("pools", 120 * MB)]
    assert ledger.total == 900 * MB and len(released) == 3
    assert ledger.summary() == ("resident memory 0.88 GB: 0.14 GB before load, 2 executables "
                                "+0.10 GB, weights +0.53 GB, pools +0.12 GB")


def test_the_ledger_says_so_where_nothing_can_be_measured():
    ledger = MemoryLedger(read=lambda: None, release=lambda: None)
    assert ledger.mark("weights") is None and ledger.phases == []
    assert not ledger.measured
    assert ledger.summary() == "resident memory not measured on this platform"


def test_this_process_is_measured_and_releasing_freed_pages_keeps_what_is_live():
    release_freed()  # what earlier tests freed goes first: only the block is measured
    before = resident_bytes()
    assert before is not None and before > 10 * MB  # Linux: /proc/self/statm
    block = bytearray(64 * MB)  # touched: resident
    held = resident_bytes()
    assert held - before > 60 * MB
    release_freed()
    assert resident_bytes() > held - 4 * MB  # live memory stays
    del block


def test_progress_counts_and_estimates_what_is_left():
    now = [0.0]
    lines = []
    p = Progress(4, lines.append, clock=lambda: now[0])
    now[0] = 2.0
    p.step("entry decode_b1_c512", "compiled in 2.0 s")
    now[0] = 4.0
    p.step("entry prefill_b1_c512", "in the cache already")
    assert lines == ["[1/4] entry decode_b1_c512: compiled in 2.0 s (2 s elapsed, ~6 s left)",
                     "[2/4] entry prefill_b1_c512: in the cache already (4 s elapsed, ~4 s left)"]

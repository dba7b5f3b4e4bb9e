"""Pure-Python pieces: page pool, step building, the compile cache."""

from __future__ import annotations

import time

import numpy as np
import pytest

from triton_tlaloc.manifest import load_artifact
from triton_tlaloc.pages import PagePool, PagesExhausted, pages_for
from triton_tlaloc.runtime import Runtime, StepInputError
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


def test_build_step_right_aligns_rows_and_pads(tiny):
    art = load_artifact(tiny.artifact("llama", False))
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


def test_runtime_checks_shape_and_dtype_that_pjrt_does_not(tiny):
    art = tiny.artifact("llama", False)
    rt = Runtime(art, entries=["decode_b1_c32"])
    entry = rt.artifact.entries["decode_b1_c32"]
    good = build_step(entry, [Row((5,), 0, (1,))], 8)
    bad = dict(good, BLOCK_TABLES=good["BLOCK_TABLES"].astype(np.float32))  # same byte size
    with pytest.raises(StepInputError, match="BLOCK_TABLES must be i32 \\[1, 4\\], got float32"):
        rt.run("decode_b1_c32", bad)
    bad = dict(good, BLOCK_TABLES=good["BLOCK_TABLES"].reshape(4, 1))
    with pytest.raises(StepInputError, match="BLOCK_TABLES must be i32 \\[1, 4\\], got int32 \\[4, 1\\]"):
        rt.run("decode_b1_c32", bad)
    assert rt.donation.runs == 0, "a refused step runs nothing"
    assert rt.run("decode_b1_c32", good).shape == (1, 256)


def test_second_load_comes_from_the_compile_cache(tiny, tmp_path):
    art = tiny.artifact("qwen3", True)
    first = Runtime(art, cache_dir=tmp_path)
    n = len(first.artifact.entries)
    assert (first.compile_stats.compiled, first.compile_stats.cache_hits) == (n, 0)
    second = Runtime(art, cache_dir=tmp_path)
    assert (second.compile_stats.compiled, second.compile_stats.cache_hits) == (0, n)
    step = build_step(first.artifact.entries["prefill_b1_c32"], [Row((1, 2, 3), 0, (1,))], 8)
    assert np.array_equal(first.run("prefill_b1_c32", step), second.run("prefill_b1_c32", step))
    # the control program (aliases stripped) is a different text: its own cache entries
    control = Runtime(art, cache_dir=tmp_path, donate=False)
    assert control.compile_stats.compiled == n


def test_no_entry_copies_its_pools(tiny):
    """An entry's temporary memory must not grow with the pools: a pool copied inside the
    program (XLA turns a one-index scatter into a dynamic-update-slice on a copy) would add a
    pool's bytes per layer. Same model, 33 and 2049 pages: the same temp bytes per entry."""
    temps = {}
    for pages in (33, 2049):
        rt = Runtime(tiny.artifact("llama", False, num_blocks=pages))
        temps[pages] = {name: ex.get_compiled_memory_stats().temp_size_in_bytes
                        for name, ex in rt.executables.items()}
        pool_bytes = rt.pool_bytes // len(rt.pools)
    assert pool_bytes > 2 * 2**20
    for name in temps[33]:
        assert temps[2049][name] == temps[33][name], (name, temps[2049][name], temps[33][name])


def test_metrics_writer_applies_updates_on_its_own_thread_in_batches():
    """metrics.MetricsWriter: counters summed, a gauge's last value, observations in order, all
    applied by its thread (nothing on the caller's), and a last flush at close."""
    import threading

    from triton_tlaloc.metrics import MetricsWriter

    class Fake:
        def __init__(self):
            self.calls, self.threads = [], set()

        def _record(self, kind, v):
            self.calls.append((kind, v))
            self.threads.add(threading.current_thread().name)

        def increment(self, v):
            self._record("increment", v)

        def set(self, v):
            self._record("set", v)

        def observe(self, v):
            self._record("observe", v)

    counter, gauge, hist = Fake(), Fake(), Fake()
    writer = MetricsWriter(interval_s=0.5)  # first flush well after the updates below
    for v in (1, 2, 3.5):
        writer.increment(counter, v)
        writer.set(gauge, v)
        writer.observe(hist, v)
    assert counter.calls == gauge.calls == hist.calls == []  # nothing on the caller's thread
    deadline = time.monotonic() + 5
    while not counter.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counter.calls == [("increment", 6.5)]
    assert gauge.calls == [("set", 3.5)]
    assert hist.calls == [("observe", 1), ("observe", 2), ("observe", 3.5)]
    assert counter.threads == {"tlaloc-metrics"}
    writer.increment(counter, 4)
    writer.close()  # flushes what is left
    assert counter.calls[-1] == ("increment", 4)


def test_small_outputs_argmax_and_top_k():
    from triton_tlaloc.outputs import small_outputs, top_k_parameter

    rng = np.random.default_rng(3)
    logits = rng.normal(size=1000).astype(np.float32)
    logits[[7, 8]] = 9.0  # a tie at the top: the lower id first, as argmax
    out = small_outputs(logits, {"ARGMAX", "TOP_K_IDS", "TOP_K_LOGPROBS"}, 5)
    assert out["ARGMAX"].tolist() == [[7]]
    want = np.argsort(-logits, kind="stable")[:5]
    assert out["TOP_K_IDS"].tolist() == [want.tolist()]
    z = logits.astype(np.float64)
    logsoftmax = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(out["TOP_K_LOGPROBS"][0], logsoftmax[want], rtol=1e-6)
    assert set(small_outputs(logits, {"ARGMAX"}, 5)) == {"ARGMAX"}
    assert small_outputs(logits, {"LOGITS"}, 5) == {}
    assert top_k_parameter(None, 1000) == 8 and top_k_parameter('{"top_k": 3}', 1000) == 3
    for bad in ('{"top_k": 0}', '{"top_k": 1001}', '{"top_k": "3"}', '{"top_k": true}'):
        with pytest.raises(ValueError, match="parameter top_k"):
            top_k_parameter(bad, 1000)

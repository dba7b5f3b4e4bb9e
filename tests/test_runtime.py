"""The PJRT runtime: step inputs checked against the program, the compile cache, pools never
copied inside a program."""

from __future__ import annotations

import os

import numpy as np
import pytest

from triton_tlaloc.runtime.core import FIRST_USE_ENV, Runtime, StepInputError
from triton_tlaloc.engine.steps import Row, build_step

# Two entries (decode and prefill at batch 1, context 32): the compile cache keeps each entry
# alike, and each costs a compile.
TWO_ENTRIES = dict(batch_ladder=(1,), context_ladder=(32,))


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
    art = tiny.artifact("qwen3", True, **TWO_ENTRIES)
    first = Runtime(art, cache_dir=tmp_path, first_use=False)
    n = len(first.artifact.entries)
    assert (first.compile_stats.compiled, first.compile_stats.cache_hits) == (n, 0)
    second = Runtime(art, cache_dir=tmp_path, first_use=False)
    assert (second.compile_stats.compiled, second.compile_stats.cache_hits) == (0, n)
    step = build_step(first.artifact.entries["prefill_b1_c32"], [Row((1, 2, 3), 0, (1,))], 8)
    assert np.array_equal(first.run("prefill_b1_c32", step), second.run("prefill_b1_c32", step))
    # the control program (aliases stripped) is a different text: its own cache entries
    control = Runtime(art, cache_dir=tmp_path, donate=False, first_use=False)
    assert control.compile_stats.compiled == n


def test_a_damaged_compile_cache_file_is_a_logged_miss_never_a_load(tiny, tmp_path, caplog):
    """4 KiB flipped in the middle of every cached executable: PJRT deserializes such bytes
    without complaint, and the first batched call on one killed the serving process. Each is
    refused by its checksum, compiled again and rewritten; results are as before."""
    from triton_tlaloc.runtime.compile_cache import unframed

    art = tiny.artifact("qwen3", True, **TWO_ENTRIES)
    first = Runtime(art, cache_dir=tmp_path, first_use=False)
    n = len(first.artifact.entries)
    files = sorted(tmp_path.glob("*.pjrt"))
    assert len(files) == n
    for f in files:
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
        f.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="checksum mismatch"):
            unframed(bytes(data))
    with caplog.at_level("WARNING", logger="triton_tlaloc.runtime"):
        second = Runtime(art, cache_dir=tmp_path, first_use=False)
    assert (second.compile_stats.compiled, second.compile_stats.cache_hits,
            second.compile_stats.refused) == (n, 0, n)
    assert sum("checksum mismatch" in r.getMessage() for r in caplog.records) == n
    step = build_step(first.artifact.entries["prefill_b1_c32"], [Row((1, 2, 3), 0, (1,))], 8)
    assert np.array_equal(first.run("prefill_b1_c32", step), second.run("prefill_b1_c32", step))
    third = Runtime(art, cache_dir=tmp_path, first_use=False)  # the rewritten files load
    assert (third.compile_stats.cache_hits, third.compile_stats.refused) == (n, 0)


def test_no_entry_copies_its_pools(tiny):
    """An entry's temporary memory must not grow with the pools: a pool copied inside the
    program (XLA turns a one-index scatter into a dynamic-update-slice on a copy) would add a
    pool's bytes per layer. Same model, 33 and 2049 pages: the same temp bytes per entry (at
    batch 1: every kind of entry, whole and chunked prefills)."""
    temps = {}
    for pages in (33, 2049):
        rt = Runtime(tiny.artifact("llama", False, num_blocks=pages, batch_ladder=(1,)),
                     first_use=False)
        temps[pages] = {name: ex.get_compiled_memory_stats().temp_size_in_bytes
                        for name, ex in rt.executables.items()}
        pool_bytes = rt.pool_bytes // len(rt.pools)
    assert pool_bytes > 2 * 2**20
    for name in temps[33]:
        assert temps[2049][name] == temps[33][name], (name, temps[2049][name], temps[33][name])



def test_a_runtime_that_compiles_on_first_use_runs_as_one_that_compiled_everything(tiny):
    """Nothing is compiled at load; a call compiles its entry and gives the logits of a runtime
    that compiled every entry. Negative control: an entry the artifact lacks is refused."""
    assert os.environ.get(FIRST_USE_ENV) == "1", "the tests' runtimes compile on first use"
    art = tiny.artifact("llama", False, **TWO_ENTRIES)
    lazy, full = Runtime(art), Runtime(art, first_use=False)
    assert len(lazy.executables) == 0 and "decode_b1_c32" in lazy.executables
    assert len(full.executables) == len(full.artifact.entries)
    step = build_step(lazy.artifact.entries["prefill_b1_c32"], [Row((1, 2, 3), 0, (1,))], 8)
    assert np.array_equal(lazy.run("prefill_b1_c32", step), full.run("prefill_b1_c32", step))
    assert set(dict(lazy.executables.items())) == {"prefill_b1_c32"}
    with pytest.raises(StepInputError, match="entry decode_b9_c32 was not compiled"):
        lazy.run("decode_b9_c32", step)


ADD_ONE = """module @add_one {
  func.func public @main(%x: tensor<4xf32>) -> tensor<4xf32> {
    %one = stablehlo.constant dense<1.0> : tensor<4xf32>
    %y = stablehlo.add %x, %one : tensor<4xf32>
    return %y : tensor<4xf32>
  }
}
"""


@pytest.mark.parametrize("locked", [True, False], ids=["locked", "control: no lock"])
def test_a_program_wanted_at_once_by_two_compilers_is_compiled_once(tmp_path, monkeypatch,
                                                                    locked):
    """Two compilers (a model's instances are processes; flock holds between two threads'
    own opens of the file as between processes) want the same program at the same moment,
    each compile taking 0.5 s: one compiles it, the other waits and loads it. Control: with the
    lock a no-op, both compile it."""
    import fcntl
    import threading
    import time

    from triton_tlaloc.runtime import compile_cache, pjrt

    device = pjrt.PjrtDevice("cpu", 0)
    real_compile = device.compile

    def slow_compile(text):
        time.sleep(0.5)
        return real_compile(text)
    monkeypatch.setattr(device, "compile", slow_compile)
    if not locked:
        monkeypatch.setattr(fcntl, "flock", lambda *a: None)
    stats, start = compile_cache.CompileStats(), threading.Barrier(2)

    def want():
        start.wait()
        compile_cache.compile_cached(device, ADD_ONE, "add_one", tmp_path, stats=stats)
    threads = [threading.Thread(target=want) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (stats.compiled, stats.cache_hits) == ((1, 1) if locked else (2, 0))


def test_a_cache_that_cannot_be_locked_still_loads(tmp_path, monkeypatch):
    """A compile cache that cannot be written (a read-only image's, filled when it was built):
    no lock can be taken, and its programs load as before. (Root writes through file modes,
    so the refusal is injected where the lock file is opened.)"""
    from triton_tlaloc.runtime import compile_cache, pjrt

    device = pjrt.PjrtDevice("cpu", 0)
    compile_cache.compile_cached(device, ADD_ONE, "add_one", tmp_path)  # the image built

    def read_only(cache_dir, key):
        raise PermissionError(13, "Read-only file system", str(cache_dir / f"{key}.lock"))
    monkeypatch.setattr(compile_cache, "_open_lock", read_only)
    stats = compile_cache.CompileStats()
    compile_cache.compile_cached(device, ADD_ONE, "add_one", tmp_path, stats=stats)
    assert (stats.compiled, stats.cache_hits) == (0, 1)

"""`tlaloc compile` fills the compile cache so a runtime loads every entry and every page
transfer program from it, compiling nothing; a cache of another artifact does not serve."""

from __future__ import annotations

from triton_tlaloc.cli import main
from triton_tlaloc.runtime.kv_transfer import PageTransfer, transfer_buckets
from triton_tlaloc.runtime.core import Runtime

# Two entries (decode and prefill at batch 1, context 32): what a cache holds does not depend on
# how many entries there are, and each costs a compile.
TWO_ENTRIES = dict(batch_ladder=(1,), context_ladder=(32,))


def test_tlaloc_compile_fills_the_cache_a_runtime_then_loads_everything_from(tiny, tmp_path,
                                                                              capsys):
    art = tiny.artifact("llama", False)
    cache = tmp_path / "cache"
    assert main(["compile", str(art), "--compile-cache-dir", str(cache), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    entries = len([line for line in out.splitlines() if "] entry " in line])
    print(out)
    assert f"/{entries + 1}] page transfer programs" in out and entries >= 4
    rt = Runtime(art, cache_dir=cache, first_use=False)
    assert (rt.compile_stats.compiled, rt.compile_stats.cache_hits) == (0, entries)
    transfer = PageTransfer(rt)
    transfer.warm(transfer_buckets(rt.artifact))
    assert transfer.compile_stats.compiled == 0 and transfer.compile_stats.cache_hits > 0
    # Run again: everything is there already, nothing compiles.
    assert main(["compile", str(art), "--compile-cache-dir", str(cache)]) == 0
    assert "0 programs compiled" in capsys.readouterr().out


def test_a_cache_filled_for_another_artifact_serves_nothing(tiny, tmp_path):
    """Negative control: the runtime's cache hits come from what `tlaloc compile` wrote for
    this artifact's programs, not from any cache file."""
    cache = tmp_path / "cache"
    assert main(["compile", str(tiny.artifact("qwen3", True, **TWO_ENTRIES)),
                 "--compile-cache-dir", str(cache), "--workers", "1"]) == 0
    rt = Runtime(tiny.artifact("llama", False, **TWO_ENTRIES), cache_dir=cache, first_use=False)
    assert rt.compile_stats.cache_hits == 0 and rt.compile_stats.compiled == len(rt.executables)
    assert len(rt.executables) == 2

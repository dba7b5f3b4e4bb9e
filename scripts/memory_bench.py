#!/usr/bin/env python3
"""Resident memory of a served model, side by side in one run: each artifact given is served by
tritonserver with a warm compile cache (`tlaloc compile` fills it first) and every entry
compiled, with freed heap pages given back after each compile (the default) and, as the
control, without (TLALOC_RELEASE_FREED=0). For each: the resident memory of the model's process
(the Python backend's stub, from /proc) and the model's own account of it by phase (the load
log's "resident memory" line: before load, executables, weights, pools, executables compiled
later). One variable changes from row to row; nothing else should run on the machine.

With `--runtimes jax,capi`, the variable is the runtime instead (freed pages given back in
each): the model's programs through JAX, or through a PJRT plugin's C API with no JAX (the
model parameter `runtime`), served alternately `--rounds` times; each row also gives the time
from tritonserver's start to the model ready (its first entries compiled, from the warm cache).

    .venv/bin/python scripts/memory_bench.py [ARTIFACT ...]   (default: artifacts/smollm2)
    .venv/bin/python scripts/memory_bench.py --runtimes jax,capi --rounds 3 [ARTIFACT ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.runtime.precompile import precompile  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402


def served(artifact: Path, cache: Path, work: Path, release: bool,
           runtime: str = "jax") -> tuple[int, str, float]:
    """The model's resident memory with every entry compiled, its own account, and the seconds
    from the server's start to the model ready."""
    repo = work / f"repo-{artifact.name}-{int(release)}-{runtime}"
    write_repository(artifact, repo, "m", RepositoryOptions(generate_model=False,
                                                            compile_cache_dir=str(cache),
                                                            runtime=runtime))
    os.environ["TLALOC_RELEASE_FREED"] = "1" if release else "0"  # the stub inherits it
    server = TritonServer(repo, exit_timeout_s=3)
    t0 = time.perf_counter()
    server.start(timeout_s=1800, wait_compiled=False)
    ready_s = time.perf_counter() - t0
    try:
        while not server.compiled():
            time.sleep(0.2)
        time.sleep(1.0)
        rss = server.stub_resident_bytes()
        lines = re.findall(r"resident memory [^\n\"]*", server.log_text())
    finally:
        server.stop()
        os.environ.pop("TLALOC_RELEASE_FREED", None)
    return rss, lines[-1] if lines else "(no resident memory line)", ready_s


def runtimes_side_by_side(artifacts: list[Path], runtimes: list[str], rounds: int) -> int:
    """The runtimes served alternately, `rounds` times each, with a warm cache for each (the
    C API runtime's executables are keyed by its plugin, so both fill it)."""
    with tempfile.TemporaryDirectory(prefix="tlaloc-memory-") as tmp:
        cache = Path(tmp) / "cache"
        print(f"{'artifact':<16} {'runtime':<8} {'RSS (median)':>13} {'ready (median)':>15} "
              f"{'rounds':>7}")
        for path in artifacts:
            for runtime in runtimes:  # warm-up: each runtime's cache filled, untimed
                served(path, cache, Path(tmp), True, runtime)
            got = {r: [] for r in runtimes}
            for _ in range(rounds):
                for runtime in runtimes:
                    rss, _, ready_s = served(path, cache, Path(tmp), True, runtime)
                    got[runtime].append((rss, ready_s))
            base = None
            for runtime in runtimes:
                rss = statistics.median(r for r, _ in got[runtime])
                ready = statistics.median(t for _, t in got[runtime])
                base = base or (rss, ready)
                print(f"{path.name:<16} {runtime:<8} {rss / 2**20:>9.0f} MiB {ready:>13.2f} s "
                      f"{rounds:>7}   RSS {rss / base[0]:.2f}x, ready {ready / base[1]:.2f}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="*", type=Path, default=[ROOT / "artifacts" / "smollm2"])
    ap.add_argument("--runtimes", default=None,
                    help="compare runtimes instead (e.g. jax,capi), freed pages given back")
    ap.add_argument("--rounds", type=int, default=3, help="--runtimes: served this many times")
    args = ap.parse_args()
    if args.runtimes:
        return runtimes_side_by_side(args.artifacts, args.runtimes.split(","), args.rounds)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tlaloc-memory-") as tmp:
        cache = Path(tmp) / "cache"
        for path in args.artifacts:
            art = load_artifact(path)
            precompile(art, cache_dir=cache, transfers=True, say=lambda line: None)
            for release in (False, True):
                rss, line, _ = served(path, cache, Path(tmp), release)
                rows.append((path.name, len(art.entries), art.context_ladder, release, rss, line))
    print("resident memory of the model's process (tritonserver's Python stub), every entry "
          "compiled, warm compile cache, CPU")
    print(f"{'artifact':<16} {'entries':>7} {'contexts':<12} {'freed pages':<12} {'RSS':>8}")
    for name, n, contexts, release, rss, _ in rows:
        print(f"{name:<16} {n:>7} {','.join(map(str, contexts)):<12} "
              f"{'given back' if release else 'kept':<12} {rss / 2**30:>5.2f} GB")
    print("the models' own accounts:")
    for name, _, _, release, _, line in rows:
        print(f"  {name} ({'given back' if release else 'kept'}): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Resident memory of a served model, side by side in one run: each artifact given is served by
tritonserver with a warm compile cache (`tlaloc compile` fills it first) and every entry
compiled, with freed heap pages given back after each compile (the default) and, as the
control, without (TLALOC_RELEASE_FREED=0). For each: the resident memory of the model's process
(the Python backend's stub, from /proc) and the model's own account of it by phase (the load
log's "resident memory" line: before load, executables, weights, pools, executables compiled
later). One variable changes from row to row; nothing else should run on the machine.

    .venv/bin/python scripts/memory_bench.py [ARTIFACT ...]   (default: artifacts/smollm2)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.runtime.precompile import precompile  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402


def served(artifact: Path, cache: Path, work: Path, release: bool) -> tuple[int, str]:
    repo = work / f"repo-{artifact.name}-{int(release)}"
    write_repository(artifact, repo, "m", RepositoryOptions(generate_model=False,
                                                            compile_cache_dir=str(cache)))
    os.environ["TLALOC_RELEASE_FREED"] = "1" if release else "0"  # the stub inherits it
    server = TritonServer(repo, exit_timeout_s=3)
    server.start(timeout_s=1800, wait_compiled=True)
    try:
        time.sleep(1.0)
        rss = server.stub_resident_bytes()
        lines = re.findall(r"resident memory [^\n\"]*", server.log_text())
    finally:
        server.stop()
        os.environ.pop("TLALOC_RELEASE_FREED", None)
    return rss, lines[-1] if lines else "(no resident memory line)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="*", type=Path, default=[ROOT / "artifacts" / "smollm2"])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tlaloc-memory-") as tmp:
        cache = Path(tmp) / "cache"
        for path in args.artifacts:
            art = load_artifact(path)
            precompile(art, cache_dir=cache, transfers=True, say=lambda line: None)
            for release in (False, True):
                rss, line = served(path, cache, Path(tmp), release)
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

"""What a test run builds once (checkpoints, artifacts), shared by its pytest-xdist workers and
by the vLLM lane."""

from __future__ import annotations

import shutil
from pathlib import Path


def built_once(path: Path, build) -> Path:
    """`path`, built by `build(path)` by the first worker that asks for it (the others wait on
    its lock, then find it done): checkpoints and artifacts are exported once per run."""
    from filelock import FileLock

    done = path.parent / f"{path.name}.done"
    with FileLock(str(path.parent / f"{path.name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a build that failed half-way
            build(path)
            done.touch()
    return path

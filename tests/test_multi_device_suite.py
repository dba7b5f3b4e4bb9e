"""tests/multi_device in a process of its own: its CPU client needs four devices, which XLA
gives only when told before JAX starts (this process started JAX with one). One process, not
several for make test's workers to share: split in three (by -k) it took 544 s of test time
against 367 s as one, each process exporting the same artifacts and starting JAX again, and on
2 cores the workers had no idle core to gain."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

MULTI = Path(__file__).parent / "multi_device"


def test_the_multi_device_tests_pass_on_four_cpu_devices(tmp_path, run_dir):
    # The run's checkpoints and compile cache are shared (tests/conftest.py RUN_DIR_ENV).
    env = {**os.environ, "TLALOC_TEST_RUN_DIR": str(run_dir)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "--basetemp", str(tmp_path / "pytest"), str(MULTI)],
                         capture_output=True, text=True, timeout=1500, cwd=MULTI.parent.parent,
                         env=env)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 10, tail
    assert not re.search(r"\d+ (failed|skipped|error)", run.stdout), tail

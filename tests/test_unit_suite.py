"""tests/unit in a process of its own, as `make unit` runs it: this process has JAX and torch
imported, and the unit tests' import guard refuses them (tests/unit/conftest.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).parent / "unit"


def test_the_unit_tests_pass_with_no_jax_torch_or_triton_imported():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "2", str(UNIT)], capture_output=True, text=True, timeout=300,
                         cwd=UNIT.parent.parent)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 30, tail
    assert "failed" not in run.stdout and "error" not in run.stdout.lower(), tail

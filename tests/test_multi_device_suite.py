"""tests/multi_device in processes of their own: its CPU client needs four devices, which XLA
gives only when told before JAX starts (this process started JAX with one). The directory runs
as three processes, so `make test`'s workers share it: the parity of four families on 1, 2 and 4
devices; SmolLM2 and `tlaloc run` on several devices; the rest (placement, donation, refusals,
the negative controls, the host tier)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

MULTI = Path(__file__).parent / "multi_device"
PARITY = "two_and_four_devices"
PROCESSES = "smollm2 or tlaloc_run"
PARTS = {  # -k expression -> the fewest tests it must pass
    PARITY: 4,
    PROCESSES: 2,
    f"not ({PARITY}) and not ({PROCESSES})": 14,
}


@pytest.mark.parametrize("part", PARTS, ids=["parity", "processes", "the rest"])
def test_the_multi_device_tests_pass_on_four_cpu_devices(tmp_path, part):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "--basetemp", str(tmp_path / "pytest"), "-k", part, str(MULTI)],
                         capture_output=True, text=True, timeout=1500, cwd=MULTI.parent.parent)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= PARTS[part], tail
    assert not re.search(r"\d+ (failed|skipped|error)", run.stdout), tail

"""A stopped server's model processes: those still running a grace period after it are killed,
found by the server's shared-memory prefix in their arguments; another server's, and one that
exited by itself (a zombie nobody reaped), are left alone. Stand-ins: a Python named as the
backend's stub, with a region name in its arguments as a stub has."""

from __future__ import annotations

import subprocess
import sys
import time

from triton_tlaloc.triton.server import end_stubs, stubs_with_prefix


def stand_in_stub(tmp_path, region: str, seconds: float) -> subprocess.Popen:
    stub = tmp_path / "triton_python_backend_stub"
    if not stub.exists():
        stub.symlink_to(sys.executable)
    return subprocess.Popen([str(stub), "-c", f"import time; time.sleep({seconds})",
                             f"{region}_3f2c9a1e"])


def test_a_stopped_servers_stubs_that_hang_are_killed_and_no_other(tmp_path):
    hung = stand_in_stub(tmp_path, "tlaloc_aaaa_", 120)
    quick = stand_in_stub(tmp_path, "tlaloc_aaaa_", 0.6)
    other = stand_in_stub(tmp_path, "tlaloc_bbbb_", 120)
    try:
        time.sleep(0.2)
        assert stubs_with_prefix("tlaloc_aaaa_") == sorted([hung.pid, quick.pid])
        t0 = time.monotonic()
        assert end_stubs("tlaloc_aaaa_", grace_s=1.5) == 1
        assert time.monotonic() - t0 >= 1.5  # the grace is given first
        assert hung.wait(5) == -9
        assert quick.poll() == 0  # exited by itself, a zombie until now: not counted
        assert other.poll() is None and stubs_with_prefix("tlaloc_bbbb_") == [other.pid]
        t0 = time.monotonic()
        assert end_stubs("tlaloc_aaaa_", grace_s=1.0) == 0
        assert time.monotonic() - t0 < 0.5  # nothing left: no wait
    finally:
        for p in (hung, quick, other):
            p.kill()
            p.wait()

"""A model process's watcher (triton/parent_watch.py), on a stand-in process: the watched
process is killed once its parent is not the one it was watched under, left alone while it is
(control), and the watcher ends with it; the environment turns the watch off."""

from __future__ import annotations

import os
import subprocess
import time

from triton_tlaloc.triton.parent_watch import WATCH_ENV, watch_parent


def ended_within(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_process_whose_parent_changed_is_killed():
    stub = subprocess.Popen(["sleep", "30"])
    # watched as if its parent had been another process: the server gone
    watcher = watch_parent(stub.pid, parent=os.getpid() + 1_000_000, poll_s=0.05)
    assert ended_within(stub, 5) and stub.returncode == -9
    assert ended_within(watcher, 5)


def test_a_process_under_its_parent_goes_on_and_its_watcher_ends_with_it():
    stub = subprocess.Popen(["sleep", "30"])
    watcher = watch_parent(stub.pid, parent=os.getpid(), poll_s=0.05)
    time.sleep(0.5)
    assert stub.poll() is None and watcher.poll() is None  # control for the test above
    stub.kill()
    stub.wait()
    assert ended_within(watcher, 5)


def test_the_environment_turns_the_watch_off(monkeypatch):
    monkeypatch.setenv(WATCH_ENV, "0")
    assert watch_parent() is None

"""Model processes end with their tritonserver, however it ends (triton/parent_watch.py): a tiny
llama's sequence model and its generate model, each a Python-backend stub; tritonserver
SIGKILLed alone, or stopped by SIGINT with a sequence still open, or by `TritonServer.stop()`:
within 10 s no stub of the server is alive. Triton's stubs mostly end by themselves, and
sometimes hang in their teardown (seen, not at will): "frozen" stands for that, the stubs
SIGSTOPped before the server is killed, so they cannot end themselves; the watch ends them.
Control: with the watch off (TLALOC_WATCH_PARENT=0) the frozen stubs outlive their server
(`stop()` then kills them)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from triton_tlaloc.frontends.client import TlalocClient
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.parent_watch import WATCH_ENV
from triton_tlaloc.triton.server import TritonServer, stubs_with_prefix

pytestmark = pytest.mark.tritonserver
WITHIN_S = 10.0


def served(tiny, work, name):
    repo = work / f"repo-lifetime-{name}"
    write_repository(tiny.artifact("llama", False), repo, "llama", RepositoryOptions())
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    assert len(stubs_with_prefix(server.shm_prefix)) == 2  # the sequence and generate models
    return server


def stubs_left(server, seconds: float = WITHIN_S) -> list[int]:
    """The server's stubs still alive `seconds` from now (sooner when none is)."""
    deadline = time.monotonic() + seconds
    while (left := stubs_with_prefix(server.shm_prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def open_sequence(server) -> None:
    with TlalocClient(server.grpc_url, "llama") as client:
        client.infer(7, [1, 17, 99, 3], start=True)  # started, never ended


def freeze_stubs(server) -> None:
    """The server's stubs stopped (SIGSTOP): they cannot end themselves, as a hung one."""
    for pid in stubs_with_prefix(server.shm_prefix):
        os.kill(pid, signal.SIGSTOP)


@pytest.mark.parametrize("how", ["sigkill", "sigkill frozen", "sigint", "stop"])
def test_no_stub_outlives_its_server(tiny, work, how):
    server = served(tiny, work, how.replace(" ", "-"))
    try:
        open_sequence(server)
        if how == "sigkill frozen":
            freeze_stubs(server)
        if how.startswith("sigkill"):
            os.kill(server.proc.pid, signal.SIGKILL)  # tritonserver alone, not its group
        elif how == "sigint":
            server.proc.send_signal(signal.SIGINT)
        else:
            server.stop()
        server.proc.wait(30)
        assert stubs_left(server) == []
    finally:
        server.stop()


def test_control_with_the_watch_off_frozen_stubs_outlive_their_server(tiny, work, monkeypatch):
    monkeypatch.setenv(WATCH_ENV, "0")  # the stubs inherit tritonserver's environment
    server = served(tiny, work, "unwatched")
    try:
        open_sequence(server)
        freeze_stubs(server)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        assert len(stubs_left(server, 3.0)) == 2  # (the watch acts within a second)
    finally:
        server.stop()
    assert stubs_with_prefix(server.shm_prefix) == []  # stop() killed it

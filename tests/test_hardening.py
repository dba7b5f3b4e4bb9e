"""Hardening: every case of checks/abuse_cases.py (bad input and floods against the sequence
model, the generate model, `tlaloc openai` and Triton's admin APIs) answered as expected, with
the server ready and a neighbour sequence's ids equal to its solo run; refused generations
leave no Triton sequence slot behind; `tlaloc serve` keeps the admin APIs closed, and stops
with open sequences with exit status 0, nothing left in /dev/shm and no model process left
running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks import abuse_cases as A
from triton_tlaloc.frontends.client import TlalocClient, generate, new_sequence_id
from triton_tlaloc.repository import RepositoryOptions
from triton_tlaloc.triton.server import (SHM_DIR, free_ports, processes_named,
                                         stubs_with_prefix)

pytestmark = pytest.mark.tritonserver

@pytest.fixture(scope="module")
def target(smollm2, work):
    t, stop = A.start_target(smollm2[1], work / "repo-hardening", max_concurrent=2)
    yield t
    stop()


@pytest.mark.parametrize("case", A.CASES, ids=[c[2].__name__[5:] for c in A.CASES])
def test_abuse_case(target, case):
    inp, expected, fn = case
    r = A.run_case(target, fn)
    assert r["ok"], f"{inp}: expected {expected}, observed {r['observed']}"
    assert r["ready"], f"{inp}: the server is not ready after it"
    assert r["neighbour_equal"], f"{inp}: the neighbour sequence's ids changed"


def test_refused_generations_end_their_sequences_when_slots_are_few(target):
    """Triton holds as many sequence slots as the pool has pages here: 3x that many refused
    generations (a token outside the vocabulary), then a normal one answered at once; without
    the generate model's END after a refused START, the slots run out and it waits for
    Triton's idle timeout."""
    url = target.server.grpc_url
    for _ in range(24):
        g = generate(url, f"{A.TIGHT}_generate", input_ids=[1, 10**9],
                     sampling={"max_tokens": 1}, timeout_s=10)
        assert g.status == "INVALID_ARGUMENT", g.error
    t0 = time.perf_counter()
    g = generate(url, f"{A.TIGHT}_generate", input_ids=[1, 2, 3], sampling={"max_tokens": 2},
                 timeout_s=10)
    assert g.error is None and time.perf_counter() - t0 < 2


def test_tlaloc_serve_closes_admin_apis_and_stops_cleanly_with_open_sequences(tiny, work):
    from triton_tlaloc.repository import write_repository

    repo = work / "repo-serve"
    write_repository(tiny.artifact("llama", False), repo, "llama", RepositoryOptions())
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "TLALOC_ADMIN_KEY": "sesame"}
    proc = subprocess.Popen([sys.executable, "-m", "triton_tlaloc.cli", "serve", str(repo),
                             "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics), "--exit-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert "ready" in proc.stdout.readline()
        # Only this server's regions: the other workers' servers come and go in /dev/shm
        regions = f"{shm_prefix_of(proc.pid)}*"
        assert list(SHM_DIR.glob(regions)), "no shared memory under the server's prefix"
        url = f"127.0.0.1:{http}"
        assert A.triton_post(url, "/v2/logging", {"log_verbose_level": 1}) == 403
        assert A.triton_post(url, "/v2/repository/index", {}) == 403
        assert A.triton_post(url, "/v2/logging", {"log_verbose_level": 0},
                     {"tlaloc-admin-key": "sesame"}) == 200
        with TlalocClient(url, "llama", "http") as c:  # left open: Ctrl-C must not wait on it
            c.request(new_sequence_id(), [1, 2, 3], start=True, outputs=("ARGMAX",))
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 0, err
    assert list(SHM_DIR.glob(regions)) == [], "shared memory left in /dev/shm"
    assert stubs_with_prefix(regions[:-1]) == [], "a model process outlived the server"


def shm_prefix_of(supervisor: int) -> str:
    """The shared-memory prefix `tlaloc serve` (pid `supervisor`) gave its tritonserver."""
    server, = processes_named("tritonserver", parent=supervisor)
    argv = Path(f"/proc/{server}/cmdline").read_bytes().decode().split("\0")
    option, = (a for a in argv if "shm-region-prefix-name=" in a)
    return option.rsplit("=", 1)[1]

"""The benchmark mode through tritonserver: with TLALOC_BENCHMARK_MODE=1 a repository with
`simulate_step_ms` loads without compiling anything and answers by the simulated rule, and
every call takes its step."""

from __future__ import annotations

import time

import numpy as np
import pytest

from triton_tlaloc.frontends.client import TlalocClient, new_sequence_id
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer
from triton_tlaloc.runtime.simulated import BENCHMARK_ENV, simulated_logits

pytestmark = pytest.mark.tritonserver


def test_a_simulated_model_serves_the_simulated_ids_at_its_step(tiny, work, monkeypatch):
    art = tiny.artifact("llama", False)
    repo = work / "repo-simulated"
    write_repository(art, repo, "sim", RepositoryOptions(
        generate_model=False, extra_parameters={"simulate_step_ms": "20"}))
    monkeypatch.setenv(BENCHMARK_ENV, "1")
    with TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False) as server:
        assert "BENCHMARK MODE" in server.log_text()
        with TlalocClient(server.grpc_url, "sim", "grpc") as c:
            sid, tokens, positions = new_sequence_id(), [5, 9, 13], 3
            got, want = [], []
            t0 = time.perf_counter()
            logits, _ = c.infer(sid, tokens, start=True)
            for step in range(4):
                token = int(np.argmax(logits))
                got.append(token)
                want.append(int(np.argmax(simulated_logits(
                    np.array([[tokens[-1]]]), np.array([[positions - 1]]), 256))))
                tokens, positions = [token], positions + 1
                logits, _ = c.infer(sid, [token], end=step == 3)
            assert time.perf_counter() - t0 >= 5 * 0.020
    assert got == want

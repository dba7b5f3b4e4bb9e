"""Entries compiled in the background (runtime/compiling.py): a runtime is ready once a first request's
entries are compiled; a request that needs an entry still compiling runs on a compiled one or
waits for it, and gets the ids it gets once everything is compiled, which are those of a
runtime that compiled everything first. Through tritonserver: ready before the background
compiles finish, progress in the log, and a long prompt sent at once answered with the ids of
the same prompt sent after."""

from __future__ import annotations

import time

import pytest

from triton_tlaloc.runtime.compiling import first_entries
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.frontends.client import TlalocClient
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

PROMPTS = [[(i * 7 + k) % 200 + 20 for i in range(n)] for k, n in ((1, 12), (2, 70), (3, 110))]


def greedy(engine: Engine) -> list[list[int]]:
    return [engine.generate_greedy(p, 10).generated_ids for p in PROMPTS]


def test_a_runtime_ready_early_answers_as_one_that_compiled_everything(tiny, tmp_path):
    art = tiny.artifact("llama", False)  # contexts 32 and 128, batches 1 and 2
    everything = greedy(Engine(Runtime(art, cache_dir=tmp_path / "warm")))
    rt = Runtime(art, cache_dir=tmp_path / "cold", background=True)
    try:
        assert len(rt.executables) == 2 and rt.entries_total == len(rt.artifact.entries)
        assert set(rt.executables) == set(first_entries(rt.artifact))
        early = greedy(Engine(rt))  # the 70- and 110-token prompts need the 128 context
        assert early == everything
        assert rt.compiler.wait_all(600)
        assert len(rt.executables) == rt.entries_total
        assert greedy(Engine(rt)) == everything
    finally:
        rt.close()


@pytest.fixture(scope="module")
def cold_server(tiny, work):
    repo = work / "repo-background"
    art = tiny.artifact("llama", False, context_ladder=(32, 64, 128))
    write_repository(art, repo, "early", RepositoryOptions(
        generate_model=False, compile_cache_dir=str(work / "cold-compile-cache")))
    server = TritonServer(repo, exit_timeout_s=3)
    lines = []
    server.start(wait_compiled=False, progress=lines.append)
    yield server, lines
    server.stop()


def test_tritonserver_is_ready_before_the_background_compiles_and_answers_meanwhile(
        cold_server):
    server, lines = cold_server
    print(f"entries still compiling when the first request was sent: {not server.compiled()}")
    with TlalocClient(server.grpc_url, "early", "grpc") as c:
        # Sent at once: the 110-token prompt's entries are likely still compiling.
        early = [c.generate_greedy(p, 10, argmax_output=True).generated_ids for p in PROMPTS]
        assert any("compile in the background" in line for line in lines), lines
        assert any("ready in" in line for line in lines), lines
        t0 = time.monotonic()
        while not server.compiled():
            assert time.monotonic() - t0 < 600, "background compiles did not finish"
            time.sleep(0.5)
        after = [c.generate_greedy(p, 10, argmax_output=True).generated_ids for p in PROMPTS]
    held = [line for line in server.log_text().splitlines() if "still compiling" in line]
    print(f"calls held back for a compile: {len(held)}", *held[:3], sep="\n")
    assert early == after

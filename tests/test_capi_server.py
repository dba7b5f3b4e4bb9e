"""The C API runtime served (`tlaloc repository --runtime capi`): the tiny llama's sequence model
runs its programs through OpenXLA's CPU plugin with no JAX in its process, beside the same
artifact served with the JAX runtime in the same tritonserver (started without waiting for the
compiles, as `tlaloc serve` starts it). Its greedy ids over gRPC and HTTP and through its
generate model (whose loop runs in that process) equal transformers'; its process has no JAX
library mapped (the JAX model's has: the control), its host tier's page copies compiled from
text; each process's resident memory is printed side by side."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from checks.oracle import load_reference, reference_greedy
from checks.sequence_checks import url_of

from triton_tlaloc.frontends.client import TlalocClient, generate
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer, processes_named, stub_processes

pytestmark = pytest.mark.tritonserver

PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 5, 60]
STEPS = 8
JAX_LIBRARIES = ("jaxlib", "xla_extension")  # what a process that imported JAX maps


def mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def resident_mib(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024


def test_a_model_served_with_runtime_capi_gives_transformers_ids_with_no_jax(tiny, work):
    art = tiny.artifact("llama", False)
    want, _ = reference_greedy(load_reference(tiny.checkpoint("llama", False)), PROMPT, STEPS)
    repo = work / "repo-capi"
    write_repository(art, repo, "capi", RepositoryOptions(runtime="capi"))
    write_repository(art, repo, "jax", RepositoryOptions(generate_model=False))
    assert 'key: "runtime" value: { string_value: "capi" }' in " ".join(
        (repo / "capi" / "config.pbtxt").read_text().split())
    with TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False) as server:
        for protocol in ("grpc", "http"):
            with TlalocClient(url_of(server, protocol), "capi", protocol) as c:
                assert c.generate_greedy(PROMPT, STEPS).generated_ids == want, protocol
        got = generate(server.grpc_url, "capi_generate", input_ids=PROMPT,
                       sampling={"max_tokens": STEPS, "ignore_eos": True})
        assert got.error is None and got.token_ids == want
        with TlalocClient(server.grpc_url, "jax", "grpc") as c:
            assert c.generate_greedy(PROMPT, STEPS).generated_ids == want
        tritonserver, = processes_named("tritonserver", parent=server.proc.pid) or [
            server.proc.pid]
        stubs = {s.model: s.pid for s in stub_processes(tritonserver)}
        maps = {model: mapped(stubs[model]) for model in ("capi", "jax")}
        assert not any(lib in maps["capi"] for lib in JAX_LIBRARIES), "JAX in the capi model"
        assert any(lib in maps["jax"] for lib in JAX_LIBRARIES)  # the control
        assert "xla_cpu_pjrt.so" in maps["capi"]
        print(f"resident memory after serving: capi {resident_mib(stubs['capi']):.0f} MiB, "
              f"jax {resident_mib(stubs['jax']):.0f} MiB")
        # its host tier's page copies, compiled from text on a thread of their own
        deadline = time.monotonic() + 60
        while not re.search(r"\[tlaloc capi\] host tier: \d+ page transfer programs ready",
                            server.log_text()):
            assert time.monotonic() < deadline, "capi's page transfer programs not compiled"
            time.sleep(0.2)

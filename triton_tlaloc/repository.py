"""`tlaloc repository`: a Triton model repository from a Tlaloc serving artifact.

Writes REPO/NAME/config.pbtxt (the sequence batcher, TOKENS in, LOGITS, KV_PAGES and the small
outputs out, the model parameters) and REPO/NAME/1/ holding the model.py shim and the artifact
(a symbolic link to it, or a copy); and beside it REPO/NAME_generate, the decoupled generate
model that streams text generated on the server through NAME. The artifact is validated first
and a bad one refused by name.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from .manifest import MANIFEST_NAME, load_artifact

TEMPLATE_DIR = Path(__file__).parent / "model_repository_template"
INSTANCE_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}


@dataclass(frozen=True)
class RepositoryOptions:
    max_sequence_idle_microseconds: int = 60_000_000
    donate_kv_pools: bool = True
    cohort_wait_microseconds: int = 20_000
    prefill_wait_microseconds: int = 2_000
    # backend_batching false and a queue delay: Triton forms the batches (a control)
    backend_batching: bool = True
    triton_queue_delay_microseconds: int = 0
    reclaim_allowance_microseconds: int = 2_000_000
    instance_kind: str = "cpu"  # cpu | gpu
    copy: bool = False  # copy the artifact instead of linking it
    compile_cache_dir: str = ""
    extra_parameters: dict = field(default_factory=dict)
    generate_model: bool = True  # also write NAME_generate


def _parameter(key: str, value) -> str:
    value = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def write_repository(artifact_dir: str | os.PathLike, repo: str | os.PathLike, name: str,
                     opts: RepositoryOptions = RepositoryOptions()) -> Path:
    """Write REPO/NAME; returns the model directory."""
    artifact = load_artifact(artifact_dir)
    if opts.instance_kind not in INSTANCE_KINDS:
        raise ValueError(f"instance kind {opts.instance_kind!r}: expected cpu or gpu")
    if opts.max_sequence_idle_microseconds <= 0:
        raise ValueError("max_sequence_idle_microseconds must be positive (Triton's default, "
                         "1 s, would end sequences between a user's turns)")
    model_dir = Path(repo) / name
    version = model_dir / "1"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version.mkdir(parents=True)
    shutil.copyfile(TEMPLATE_DIR / "model.py", version / "model.py")
    src = artifact.path.resolve()
    if opts.copy:
        shutil.copytree(src, version / "artifact")
    else:
        (version / "artifact").symlink_to(src, target_is_directory=True)
    decode_batches = [e.batch for e in artifact.entries.values() if e.kind == "decode"]
    params = {
        "serving_manifest": f"artifact/{MANIFEST_NAME}",
        "donate_kv_pools": "true" if opts.donate_kv_pools else "false",
        "cohort_wait_microseconds": opts.cohort_wait_microseconds,
        "prefill_wait_microseconds": opts.prefill_wait_microseconds,
        "backend_batching": "true" if opts.backend_batching else "false",
        "reclaim_allowance_microseconds": opts.reclaim_allowance_microseconds,
        # Where `tlaloc generate` finds the tokenizer when it runs on the serving machine.
        "tokenizer_dir": str(src / "tokenizer") if artifact.tokenizer_dir else "",
        **({"compile_cache_dir": opts.compile_cache_dir} if opts.compile_cache_dir else {}),
        **opts.extra_parameters,
    }
    text = Template((TEMPLATE_DIR / "config.pbtxt.in").read_text()).substitute(
        artifact=artifact.model.model_name,
        name=name,
        max_batch_size=max(decode_batches),
        vocab=artifact.model.vocab,
        max_sequence_idle_microseconds=opts.max_sequence_idle_microseconds,
        # Every sequence holds at least one page: Triton's slot count must never be what limits
        # admission (a sequence past it waits unanswered); the page policy refuses by name.
        max_candidate_sequences=artifact.model.num_blocks - 1,
        max_queue_delay_microseconds=opts.triton_queue_delay_microseconds,
        instance_kind=INSTANCE_KINDS[opts.instance_kind],
        parameters=",\n".join(_parameter(k, v) for k, v in params.items()),
    )
    (model_dir / "config.pbtxt").write_text(text)
    if opts.generate_model:
        _write_generate_model(artifact, Path(repo), name, params["tokenizer_dir"])
    return model_dir


def generate_model_name(name: str) -> str:
    return f"{name}_generate"


def _write_generate_model(artifact, repo: Path, name: str, tokenizer_dir: str) -> Path:
    model_dir = repo / generate_model_name(name)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    shutil.copyfile(TEMPLATE_DIR / "generate" / "model.py", model_dir / "1" / "model.py")
    params = {"sequence_model": name, "tokenizer_dir": tokenizer_dir,
              "max_context": artifact.max_context,
              "eos_token_ids": ",".join(str(t) for t in artifact.model.eos_token_ids)}
    text = Template((TEMPLATE_DIR / "generate" / "config.pbtxt.in").read_text()).substitute(
        name=generate_model_name(name), sequence_model=name,
        parameters=",\n".join(_parameter(k, v) for k, v in params.items()))
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir

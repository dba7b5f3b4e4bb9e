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

from .artifact.loading import load_artifact
from .artifact.manifest import MANIFEST_NAME
from .model_parameters import (DEFAULTS, MAX_SEQUENCE_IDLE_MICROSECONDS, default_bool,
                               default_float, default_int)

TEMPLATE_DIR = Path(__file__).parent / "model_repository_template"
INSTANCE_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
RUNTIMES = ("jax", "capi")  # how the sequence model runs the programs (runtime parameter)


@dataclass(frozen=True)
class RepositoryOptions:
    """What `tlaloc repository` writes; the model parameters' defaults are model_parameters.py's
    (each written there once)."""

    max_sequence_idle_microseconds: int = MAX_SEQUENCE_IDLE_MICROSECONDS
    donate_kv_pools: bool = default_bool("donate_kv_pools")
    cohort_wait_microseconds: int = default_int("cohort_wait_microseconds")
    # the cohort wait is also at most this many decode calls
    cohort_wait_steps: float = default_float("cohort_wait_steps")
    prefill_wait_microseconds: int = default_int("prefill_wait_microseconds")
    mixed_chunk_tokens: int = default_int("mixed_chunk_tokens")
    # backend_batching false and a queue delay: Triton forms the batches (a control)
    backend_batching: bool = default_bool("backend_batching")
    triton_queue_delay_microseconds: int = 0
    reclaim_allowance_microseconds: int = default_int("reclaim_allowance_microseconds")
    instance_kind: str = "cpu"  # cpu | gpu
    # Data-parallel instances, each with its own devices, pools and batcher; Triton's sequence
    # batcher keeps every request of a sequence on one instance.
    instances: int = 1
    # The instances' devices, the artifact's N each in instance order (): 0, 1, 2, ...)
    devices: tuple[int, ...] = ()
    copy: bool = False  # copy the artifact instead of linking it
    compile_cache_dir: str = ""
    extra_parameters: dict = field(default_factory=dict)
    generate_model: bool = True  # also write NAME_generate
    draft_model: str = ""  # the sequence model NAME_generate drafts with (speculative decoding)
    sequence_slots: int = 0  # max_candidate_sequences (0: sequence_slots()'s default)
    prefix_reuse: bool = default_bool("prefix_reuse")  # cached prompt blocks reused
    # a mixture of experts: tokens routed to each expert as metrics
    expert_load_metrics: bool = default_bool("expert_load_metrics")
    host_kv_bytes: int | None = None  # the host tier's budget (None: 4x the pools; 0: off)
    runtime: str = DEFAULTS["runtime"]  # jax | capi (a PJRT plugin's C API, no JAX)
    pjrt_plugin: str = ""  # runtime capi: the plugin's library ("": found by default)
    # LoRA adapters served by name: (name, PEFT adapter directory) each
    lora: tuple[tuple[str, str], ...] = ()
    lora_host_bytes: int = default_int("lora_host_bytes")
    lora_updates_root: str = ""  # adapters loaded while serving come from here ("": none)
    # how long a request waits for pages
    preempt_wait_microseconds: int = default_int("preempt_wait_microseconds")
    # ready once a first request's entries are compiled
    background_compile: bool = default_bool("background_compile")
    # threads that send the responses (0: the batching thread)
    reply_threads: int = default_int("reply_threads")
    # Where NAME_generate's loop runs: "local" (in NAME's process, over a local link) or "bls"
    # (a BLS call to NAME per token)
    generation_loop: str = "local" if default_bool("local_generation") else "bls"


GENERATION_LOOPS = ("local", "bls")

# Triton's sequence slots (max_candidate_sequences) by default: far more than the pool can hold.
MIN_SEQUENCE_SLOTS = 1024


def sequence_slots(num_blocks: int, asked: int = 0) -> int:
    """Triton's slot count must never be what limits admission: a sequence past it waits
    unanswered in Triton's backlog, while the page policy refuses by name. Every live sequence
    holds at least one page, but a START the backend refuses keeps its slot until the client
    ENDs it or Triton's idle timeout ends it; so there are many more slots than pages, and
    clients that do not END refused sequences cannot starve the rest."""
    if asked and asked < num_blocks - 1:
        raise ValueError(f"sequence_slots {asked}: fewer than the sequences the KV pool can hold "
                         f"({num_blocks - 1}); Triton would make the rest wait unanswered")
    return asked or max(num_blocks - 1, MIN_SEQUENCE_SLOTS)


def _instance_group(artifact, opts: RepositoryOptions) -> tuple[str, dict]:
    """The instance group's kind and the parameters that place its instances. One device per
    instance on a GPU is Triton's own placement (KIND_GPU); an instance over several GPUs, or
    several instances, are KIND_MODEL and take their devices from the `devices` parameter
    (as vllm_backend's tensor-parallel instances do). On the CPU each instance's process has
    its own virtual devices."""
    n, k = artifact.devices, opts.instances
    if k < 1:
        raise ValueError(f"instances {k}: expected 1 or more")
    if n == 1 and k == 1 and not opts.devices:
        return INSTANCE_KINDS[opts.instance_kind], {}
    if opts.devices and (len(opts.devices) != n * k or len(set(opts.devices)) != n * k):
        raise ValueError(f"devices {list(opts.devices)}: {k} instance(s) of an artifact lowered "
                         f"for {n} device(s) need {n * k} distinct devices")
    if opts.instance_kind == "cpu":  # each instance's process: its first N CPU devices
        return INSTANCE_KINDS["cpu"], ({"devices": ",".join(map(str, opts.devices))}
                                       if opts.devices else {})
    devices = opts.devices or tuple(range(n * k))
    return "KIND_MODEL", {"devices": ",".join(map(str, devices)), "platform": "cuda"}


def _link_or_copy(src: Path, target: Path, copy: bool) -> None:
    """Put a file or directory into a model's version directory: a copy, or a symbolic link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if copy:
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, target)
    else:
        target.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def _parameter(key: str, value) -> str:
    value = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def _lora_adapters(artifact, adapters: tuple[tuple[str, str], ...]) -> str:
    """The lora_adapters parameter: NAME=DIR,... with each directory absolute; refused when the
    artifact takes no adapters or a name repeats (the adapters themselves are read and checked
    when the model loads)."""
    if artifact.lora is None:
        raise ValueError(f"--lora: the artifact {artifact.path} takes no adapters (export it "
                         f"with --max-lora-rank)")
    names = [n for n, _ in adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora: adapter names repeat: {', '.join(names)}")
    for n, d in adapters:
        if not n or "," in n or "=" in n or "," in str(d):
            raise ValueError(f"--lora {n}={d}: a name and a directory without ',' or '='")
    return ",".join(f"{n}={Path(d).resolve()}" for n, d in adapters)


def write_repository(artifact_dir: str | os.PathLike, repo: str | os.PathLike, name: str,
                     opts: RepositoryOptions = RepositoryOptions()) -> Path:
    """Write REPO/NAME; returns the model directory."""
    artifact = load_artifact(artifact_dir)
    if opts.generation_loop not in GENERATION_LOOPS:
        raise ValueError(f"generation loop {opts.generation_loop!r}: expected local or bls")
    if opts.instance_kind not in INSTANCE_KINDS:
        raise ValueError(f"instance kind {opts.instance_kind!r}: expected cpu or gpu")
    if opts.runtime not in RUNTIMES:
        raise ValueError(f"runtime {opts.runtime!r}: one of {', '.join(RUNTIMES)}")
    if opts.pjrt_plugin and opts.runtime != "capi":
        raise ValueError("pjrt_plugin: for runtime capi only")
    if opts.max_sequence_idle_microseconds <= 0:
        raise ValueError("max_sequence_idle_microseconds must be positive (Triton's default, "
                         "1 s, would end sequences between a user's turns)")
    kind, placement = _instance_group(artifact, opts)
    model_dir = Path(repo) / name
    version = model_dir / "1"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version.mkdir(parents=True)
    shutil.copyfile(TEMPLATE_DIR / "model.py", version / "model.py")
    src = artifact.path.resolve()
    _link_or_copy(src, version / "artifact", opts.copy)
    decode_batches = [e.batch for e in artifact.entries.values() if e.kind == "decode"]
    params = {
        "serving_manifest": f"artifact/{MANIFEST_NAME}",
        "donate_kv_pools": "true" if opts.donate_kv_pools else "false",
        "cohort_wait_microseconds": opts.cohort_wait_microseconds,
        "cohort_wait_steps": opts.cohort_wait_steps,
        "prefill_wait_microseconds": opts.prefill_wait_microseconds,
        "mixed_chunk_tokens": opts.mixed_chunk_tokens,
        "backend_batching": "true" if opts.backend_batching else "false",
        "reclaim_allowance_microseconds": opts.reclaim_allowance_microseconds,
        "prefix_reuse": "true" if opts.prefix_reuse else "false",
        "expert_load_metrics": "true" if opts.expert_load_metrics else "false",
        "runtime": opts.runtime,
        **({"pjrt_plugin": str(Path(opts.pjrt_plugin).resolve())} if opts.pjrt_plugin else {}),
        **({"host_kv_bytes": opts.host_kv_bytes} if opts.host_kv_bytes is not None else {}),
        **({"lora_adapters": _lora_adapters(artifact, opts.lora)} if opts.lora else {}),
        "lora_host_bytes": opts.lora_host_bytes,
        **({"lora_updates_root": str(Path(opts.lora_updates_root).resolve())}
           if opts.lora_updates_root else {}),
        "preempt_wait_microseconds": opts.preempt_wait_microseconds,
        "background_compile": "true" if opts.background_compile else "false",
        "reply_threads": opts.reply_threads,
        "local_generation": "true" if opts.generation_loop == "local" else "false",
        # Where `tlaloc generate` finds the tokenizer when it runs on the serving machine.
        "tokenizer_dir": _tokenizer_dir(artifact),
        **({"compile_cache_dir": opts.compile_cache_dir} if opts.compile_cache_dir else {}),
        **placement,
        **opts.extra_parameters,
    }
    text = Template((TEMPLATE_DIR / "config.pbtxt.in").read_text()).substitute(
        artifact=artifact.model.model_name,
        name=name,
        max_batch_size=max(decode_batches),
        vocab=artifact.model.vocab,
        max_sequence_idle_microseconds=opts.max_sequence_idle_microseconds,
        max_candidate_sequences=sequence_slots(artifact.model.num_blocks, opts.sequence_slots),
        max_queue_delay_microseconds=opts.triton_queue_delay_microseconds,
        instance_count=opts.instances,
        instance_kind=kind,
        parameters=",\n".join(_parameter(k, v) for k, v in params.items()),
    )
    (model_dir / "config.pbtxt").write_text(text)
    if opts.generate_model:
        write_generate_model(artifact, Path(repo), name, opts.generation_loop,
                             draft_model=opts.draft_model)
    return model_dir


def generate_model_name(name: str) -> str:
    return f"{name}_generate"


def _tokenizer_dir(artifact) -> str:
    return str(artifact.path.resolve() / "tokenizer") if artifact.tokenizer_dir else ""


def write_generate_model(artifact, repo: Path, name: str, generation_loop: str = "local",
                         model_name: str = "", draft_model: str = "") -> Path:
    """REPO/NAME_generate (or `model_name`), the generate model of sequence model NAME;
    `draft_model`, the sequence model (in the same repository) it drafts with."""
    model_name = model_name or generate_model_name(name)
    model_dir = repo / model_name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    shutil.copyfile(TEMPLATE_DIR / "generate" / "model.py", model_dir / "1" / "model.py")
    params = {"sequence_model": name, "tokenizer_dir": _tokenizer_dir(artifact),
              "max_context": artifact.max_context, "vocab": artifact.model.vocab,
              "eos_token_ids": ",".join(str(t) for t in artifact.model.eos_token_ids),
              "generation_loop": generation_loop, "draft_model": draft_model}
    text = Template((TEMPLATE_DIR / "generate" / "config.pbtxt.in").read_text()).substitute(
        name=model_name, sequence_model=name,
        parameters=",\n".join(_parameter(k, v) for k, v in params.items()))
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir


# ------------------------------------------------------------------ programs

@dataclass(frozen=True)
class ProgramOptions:
    """A bounded or generic program's model
    (docs/serving.md#programs-that-are-not-language-models)."""
    arguments: str = ""  # generic: "input:X,weight:w.bin,state:s", one per @main argument
    results: str = ""  # generic: "output:Y,state:s", one per @main result
    max_batch_size: int = 0  # > 0: Triton's dynamic batcher (a stateless generic program)
    group_by_shape: bool = True
    max_queue_delay_microseconds: int = 2_000
    donate_state: bool = True
    instance_kind: str = "cpu"
    instance_count: int = 1
    copy: bool = False
    compile_cache_dir: str = ""
    extra_parameters: dict = field(default_factory=dict)


def _tensor_config(name: str, triton_type: str, dims, ragged: bool = False) -> str:
    dims_text = ", ".join("-1" if d is None or isinstance(d, str) else str(d) for d in dims)
    return (f"  {{ name: \"{name}\" data_type: {triton_type} dims: [ {dims_text} ]"
            + (" allow_ragged_batch: true" if ragged else "") + " }")


def write_program_repository(source: str | os.PathLike, repo: str | os.PathLike, name: str,
                             opts: ProgramOptions = ProgramOptions()) -> Path:
    """REPO/NAME for a bounded-program artifact (a directory holding tlaloc-bounded.json) or a
    generic StableHLO program (a .mlir file; its weight files are named relative to it)."""
    from .programs.bounded import BOUNDED_MANIFEST, load_bounded
    from .programs.generic import (ARGUMENT_KINDS, RESULT_KINDS, TRITON_TYPES, ProgramError,
                                   check_bindings, format_bindings, parse_bindings)
    from .artifact.stablehlo import read_signature

    src = Path(source).resolve()
    if opts.instance_kind not in INSTANCE_KINDS:
        raise ValueError(f"instance kind {opts.instance_kind!r}: expected cpu or gpu")
    model_dir = Path(repo) / name
    version = model_dir / "1"
    params: dict = {}
    batching = ""
    max_batch = opts.max_batch_size
    if (src / BOUNDED_MANIFEST).is_file():
        art = load_bounded(src)
        if max_batch:
            raise ProgramError("a bounded program is served one request at a time: "
                               "max_batch_size must be 0")
        inputs = [_tensor_config(s.name, TRITON_TYPES[s.dtype], s.dims) for s in art.inputs]
        outputs = [_tensor_config(s.name, TRITON_TYPES[s.dtype], s.dims) for s in art.outputs]
        params["bounded_manifest"] = f"artifact/{BOUNDED_MANIFEST}"
        place = [(src, "artifact")]
    elif src.is_file():
        sig = read_signature(src.read_text())
        args = parse_bindings(opts.arguments, ARGUMENT_KINDS, "arguments")
        results = parse_bindings(opts.results, RESULT_KINDS, "results")
        check_bindings(sig, args, results, src.parent, load=False)  # what the model checks
        stateful = any(b.kind == "state" for b in args)
        if max_batch and stateful:
            raise ProgramError("a program with state runs one request at a time, in order: "
                               "max_batch_size must be 0")
        tensors = [(b, t) for b, t in zip(args, sig.inputs) if b.kind == "input"]
        outs = [(b, t) for b, t in zip(results, sig.results) if b.kind == "output"]
        if max_batch:
            for b, t in tensors + outs:
                if not t.dims:
                    raise ProgramError(f"{b}: a batched program's inputs and outputs need a "
                                       f"leading batch axis; it is {t}")
                if t.dims[0] is not None and t.dims[0] != max_batch:
                    raise ProgramError(f"{b} is {t}: its batch axis is {t.dims[0]}, so "
                                       f"max_batch_size must be {t.dims[0]}")
        cut = 1 if max_batch else 0
        inputs = [_tensor_config(b.name, TRITON_TYPES[t.dtype], t.dims[cut:],
                                 ragged=bool(max_batch) and not t.static)
                  for b, t in tensors]
        outputs = [_tensor_config(b.name, TRITON_TYPES[t.dtype], t.dims[cut:]) for b, t in outs]
        params.update(program=src.name, arguments=format_bindings(args),
                      results=format_bindings(results), group_by_shape=str(
                          opts.group_by_shape).lower(),
                      donate_state=str(opts.donate_state).lower())
        place = [(src, src.name)] + [(src.parent / b.name, b.name) for b in args
                                     if b.kind == "weight"]
        if max_batch:
            # Ragged batches are formed by Triton and split by shape in the backend.
            batching = (f"dynamic_batching {{ max_queue_delay_microseconds: "
                        f"{opts.max_queue_delay_microseconds} }}\n")
    else:
        raise ProgramError(f"{src}: neither a bounded-program artifact (no {BOUNDED_MANIFEST}) "
                           f"nor a StableHLO program file")
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version.mkdir(parents=True)
    shutil.copyfile(TEMPLATE_DIR / "program" / "model.py", version / "model.py")
    for path, rel in place:
        _link_or_copy(path, version / rel, opts.copy)
    if opts.compile_cache_dir:
        params["compile_cache_dir"] = opts.compile_cache_dir
    params.update(opts.extra_parameters)
    text = Template((TEMPLATE_DIR / "program" / "config.pbtxt.in").read_text()).substitute(
        source=src.name, name=name, max_batch_size=max_batch,
        inputs=",\n".join(inputs), outputs=",\n".join(outputs), batching=batching,
        instance_count=opts.instance_count, instance_kind=INSTANCE_KINDS[opts.instance_kind],
        parameters=",\n".join(_parameter(k, v) for k, v in params.items()))
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir

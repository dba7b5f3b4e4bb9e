"""The PJRT runtime: compiles an artifact's bodies from their text, holds the weights and the KV
pools on the device, and runs entries with the pools donated.

- Bodies are compiled from StableHLO text through JAX's PJRT client (no retracing). Compiled
  executables are cached on disk, keyed by the sha256 of the text compiled, the platform and
  its version, and the jax/jaxlib versions.
- Weights are uploaded once. Pools are allocated on the device by a jitted zeros (pools built
  from host buffers were copied on their first execution; docs/design.md#donation).
- `run` (decode and prefill entries: the logits) and `run_positions` (verify entries: the
  argmax after every position, the logits only when asked for) check every step input's shape
  and dtype against the program (PJRT checks only byte sizes), donate the pools, and replace
  them with the outputs XLA wrote over them. They count the runs whose pools stayed at their
  addresses (in place) and those that moved (copied).
- No host view of a pool is ever kept: a live numpy view of a CPU buffer silently disables
  donation. `pool_snapshot` copies.
- `first_use`: each entry is compiled the first time a call runs it (every entry counts as
  there for the engine's choice, so the calls are those of a runtime that compiled them all).
  For work in one process that touches a few of an artifact's entries (the tests run 2 or 3 of
  8 to 12); a served model never uses it. Its default is the environment's
  `TLALOC_COMPILE_ON_FIRST_USE=1`.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..artifact.loading import load_artifact
from ..artifact.manifest import (CHUNK_ROLES, EXPERT_LOAD, LOGITS, LORA_POOL, LORA_STEP_ROLES,
                                 POOL_IN_ROLES, POOL_OUT_ROLES, POSITION_ARGMAX,
                                 POSITION_LOGITS, STATE_STEP_ROLES, STEP_ROLES, WEIGHT,
                                 WINDOW_STEP_ROLES, Artifact, Entry, numpy_dtype)
from .adapter_pools import AdapterPools
from .compiling import BackgroundCompiler, compile_order, compile_workers, first_entries
from .memory import MemoryLedger
from .pjrt import open_devices
from .compile_cache import CompileStats, compile_cached, default_cache_dir
from ..artifact.stablehlo import strip_aliasing

log = logging.getLogger("triton_tlaloc.runtime")

# The inputs a call supplies (the rest are pools and weights the runtime holds).
CALL_ROLES = (STEP_ROLES + WINDOW_STEP_ROLES + STATE_STEP_ROLES + LORA_STEP_ROLES
              + CHUNK_ROLES)

# How many runs have their pools' addresses checked: the first CHECKED_RUNS runs, and the first
# run of every entry (checking every run costs host time and tells nothing new;
# docs/design.md#donation).
CHECKED_RUNS = 100

FIRST_USE_ENV = "TLALOC_COMPILE_ON_FIRST_USE"


class StepInputError(ValueError):
    """A step input that does not match the entry's signature; names the input."""


class CompiledOnFirstUse(dict):
    """The executables of a runtime that compiles an entry the first time a call runs it:
    every entry it was given is `in` it, and looking one up compiles it if it is not yet."""

    def __init__(self, names, compile_entry):
        super().__init__()
        self.names = frozenset(names)
        self.compile_entry = compile_entry

    def __contains__(self, name) -> bool:
        return name in self.names

    def __missing__(self, name):
        if name not in self.names:
            raise KeyError(name)
        executable = self[name] = self.compile_entry(name)
        return executable

    def get(self, name, default=None):
        return self[name] if name in self.names else default


@dataclass
class DonationStats:
    in_place: int = 0
    copied: int = 0
    checked_runs: int = 0
    runs: int = 0
    entries_checked: set = field(default_factory=set)


def _per_device(device, values) -> list[int]:
    """Bytes the values hold on each device."""
    total = [0] * device.size
    for value in values:
        for j, b in enumerate(device.nbytes(value)):
            total[j] += b
    return total


def _on_devices(per_device: list[int]) -> str:
    """", each of 2 devices 1.2 MiB" for a log line (empty on one device)."""
    if len(per_device) == 1:
        return ""
    low, high = min(per_device) / 2**20, max(per_device) / 2**20
    each = f"{low:.1f}" if low == high else f"{low:.1f} to {high:.1f}"
    return f", {each} MiB on each of {len(per_device)} devices"


@dataclass
class _CallPlan:
    args: list  # the weights at their positions, None where a call fills in
    step: list  # (position, TensorSpec, numpy dtype) of each step input
    pools: list  # (position, pool name) of each pool input
    outputs: list  # (role, pool name or None) of each output, in order
    returns: frozenset  # the roles of the outputs that are not pools (LOGITS; verify's two)
    adapters: list = field(default_factory=list)  # (position, adapter pool name)


class Runtime:
    """An artifact on one device, or on the devices of a tensor-parallel artifact: compiled
    entries, weights, pools, and `run`."""

    def __init__(self, artifact: Artifact | str | os.PathLike, *, platform: str = "cpu",
                 device_index: int = 0, donate: bool = True, cache_dir: Path | None = None,
                 entries: list[str] | None = None, use_cache: bool = True,
                 check_every_run: bool = False, background: bool = False,
                 devices: tuple[int, ...] | None = None, first_use: bool | None = None,
                 expert_load: bool = False, plugin: str | None = None):
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.donate = donate
        # plugin: the C API runtime's PJRT plugin ("" finds the installed one; runtime/capi.py)
        self.device = open_devices(self.artifact, platform, device_index, devices, plugin)
        # What the load adds to the process's resident memory, by phase (runtime/memory.py); JAX and
        # its client count as before the load.
        self.memory = MemoryLedger()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.use_cache = use_cache
        self.check_every_run = check_every_run
        self.compile_stats = CompileStats()
        self.donation = DonationStats()
        # Seconds spent in each phase of `run`, summed over all runs (the step profile).
        self.phase_seconds = {"inputs": 0.0, "execute": 0.0, "copy": 0.0}
        # A mixture of experts with `expert_load`: the (token, expert) pairs each sparse layer
        # routed to each expert, summed over every call ([sparse layers, experts]; each call's
        # EXPERT_LOAD output read back with its logits). None: not counted.
        experts = self.artifact.model.experts
        self.expert_load = np.zeros(experts, np.int64) if expert_load and experts else None
        names = entries if entries is not None else sorted(self.artifact.entries)
        self.entries_total = len(names)
        if first_use is None:
            first_use = (entries is None and not background
                         and os.environ.get(FIRST_USE_ENV, "") == "1")
        self.executables: dict[str, object] = (
            CompiledOnFirstUse(names, self._compile) if first_use else {})
        # background: only what a first request needs now, the rest on compile threads.
        now = [n for n in first_entries(self.artifact) if n in names] if background else names
        if not first_use:
            for name in now or names:
                self.executables[name] = self._compile(name)
        self.memory.mark(f"{len(self.executables)} executables")
        self.weights = self._upload_weights()
        self.memory.mark("weights")
        self.pools = self._allocate_pools()
        # LoRA adapters (model.lora): the adapter pools, slots written by load_adapter
        lora = self.artifact.lora
        self.adapters = AdapterPools(self, lora) if lora is not None else None
        self.memory.mark("pools")
        log.info("%s", self.memory.summary())
        self._plans = {name: self._plan(self.artifact.entries[name])
                       for name in (names if first_use else self.executables)}
        self.compiled_at_load = len(self.executables)
        self._publishing = threading.Lock()
        self.compiler = None
        self.on_compiled = None  # called with (compiled, total) as each entry is compiled
        rest = [n for n in names if n not in self.executables]
        if first_use:
            log.info("%d entries compile the first time a call runs them", len(names))
        elif rest:
            self.compiler = BackgroundCompiler(
                compile_order(self.artifact, rest),
                self._compile, self._add_executable, compile_workers()).start()
            log.info("%d of %d entries compiled; %d more compile in the background on %d "
                     "threads", len(self.executables), len(names), len(rest),
                     compile_workers())

    # ---------------------------------------------------------------- load

    def _compile(self, name: str):
        entry = self.artifact.entries[name]
        text = self.artifact.body_text(entry)
        if not self.donate:
            text = strip_aliasing(text)  # the control: the same program, pools copied
        return compile_cached(self.device, text, f"entry {entry.name}", self.cache_dir,
                              self.use_cache, self.compile_stats)

    def _add_executable(self, name: str, executable) -> None:
        # Its plan first: a call that finds the executable finds its plan.
        self._plans[name] = self._plan(self.artifact.entries[name])
        with self._publishing:  # compile threads: exactly one of them sees the last entry
            self.executables[name] = executable
            last = len(self.executables) == self.entries_total
        if last:
            # (also counts what serving allocated meanwhile)
            self.memory.mark(f"{self.entries_total - self.compiled_at_load} executables "
                             "compiled later")
            log.info("every entry compiled: %s", self.memory.summary())
        if self.on_compiled is not None:
            self.on_compiled(len(self.executables), self.entries_total)

    def want(self, name: str) -> None:
        """A call would rather run on entry `name`: compile it next."""
        if self.compiler is not None:
            self.compiler.want(name)

    def compiling(self, name: str) -> bool:
        """Whether entry `name` is still to compile in the background (queued or under way)."""
        return (name not in self.executables and self.compiler is not None
                and self.compiler.pending(name))

    def wait_for(self, name: str) -> None:
        """Block until entry `name` is compiled (it is compiling in the background)."""
        if name in self.executables:
            return
        if self.compiler is None:
            raise StepInputError(f"entry {name} was not compiled in this runtime")
        self.compiler.wait_for(name)

    def close(self) -> None:
        """Stop compiling in the background (a compile under way finishes)."""
        if self.compiler is not None:
            self.compiler.stop()

    def _upload_weights(self) -> dict[str, object]:
        t0 = time.perf_counter()
        out = {}
        total = 0
        tp = self.artifact.tensor_parallel
        n = self.device.size
        # A file's bytes go up as the programs take them: its dtype, or its bits.
        as_taken = self.artifact.weight_input_dtypes()
        for w in self.artifact.weights:
            path, dtype = self.artifact.path / w.file, numpy_dtype(as_taken[w.slot])
            split = tp.weights.get(w.slot) if tp is not None else None
            if split is None:
                out[w.slot] = self.device.put(np.fromfile(path, dtype=dtype).reshape(w.shape))
            else:  # each device gets its slices of the file, never the whole tensor
                mapped = np.memmap(path, dtype=dtype, mode="r", shape=w.shape)
                out[w.slot] = self.device.put_shards([split.shard(mapped, j, n)
                                                      for j in range(n)])
                del mapped
            total += w.byte_length
        # A put copies on a thread of the client's, and the host arrays outlive it until a
        # collection: wait for the copies and collect, so the host copies are gone here and the
        # memory ledger counts the weights once, in this phase (they were 0.25 GB of "pools").
        # The young generations hold them: collecting those takes 3 ms where a full collection
        # takes 0.75 s in a process holding torch and transformers (a test's), with the same
        # ledger (SmolLM2: weights +0.50 GB, pools +0.08 GB; without it +0.80 and -0.22).
        for value in out.values():
            self.device.wait(self.device.first(value))
        gc.collect(1)
        self.weight_bytes = total
        self.weight_device_bytes = _per_device(self.device, out.values())
        m = self.artifact.model
        quant = "" if not m.quantized else f", {m.quantized}" + (
            "" if m.packed else " with per-channel scales")
        log.info("weights: %d tensors, %.1f MiB (%s%s) uploaded in %.2f s%s", len(out),
                 total / 2**20, m.weight_dtype, quant, time.perf_counter() - t0,
                 _on_devices(self.weight_device_bytes))
        return out

    def _allocate_pools(self) -> dict[str, object]:
        """The KV pools and the linear-attention state pools (schema v4), zeroed on the device."""
        every = (*self.artifact.pools, *self.artifact.state_pools)
        tp = self.artifact.tensor_parallel
        held = self.artifact.pool_input_dtypes()  # an f8 pool as its bytes (manifest.BITS)
        specs = [(p.shape if tp is None else tp.pools[p.name].shard_shape(p.shape, tp.devices),
                  numpy_dtype(held[p.name])) for p in every]
        pools = dict(zip((p.name for p in every), self.device.zeros(specs)))
        for value in pools.values():
            self.device.wait(self.device.first(value))
        self.kv_device_bytes = _per_device(self.device, [pools[p.name]
                                                         for p in self.artifact.pools])
        self.state_device_bytes = _per_device(self.device, [pools[p.name] for p in
                                                            self.artifact.state_pools])

        def nbytes(ps):
            return sum(int(np.prod(p.shape)) * numpy_dtype(p.dtype).itemsize for p in ps)

        self.kv_pool_bytes = nbytes(self.artifact.pools)
        self.state_pool_bytes = nbytes(self.artifact.state_pools)
        self.pool_bytes = self.kv_pool_bytes + self.state_pool_bytes
        m = self.artifact.model
        log.info("KV pools: %d pools of %d pages x %d tokens, %s, %.1f MiB%s",
                 len(self.artifact.pools), m.num_blocks, m.block_size, m.kv_dtype,
                 self.kv_pool_bytes / 2**20, _on_devices(self.kv_device_bytes))
        ls = self.artifact.linear_state
        if ls is not None:
            log.info("state pools: %d pools of %d slots, %.1f KiB a sequence at any context, "
                     "%.1f MiB", len(ls.pools), ls.num_slots, ls.bytes_per_slot / 2**10,
                     self.state_pool_bytes / 2**20)
        return pools

    @property
    def pool_device_bytes(self) -> list[int]:
        """KV and state pool bytes on each device."""
        return [a + b for a, b in zip(self.kv_device_bytes, self.state_device_bytes)]

    def _plan(self, entry: Entry) -> "_CallPlan":
        """Where each argument of an entry comes from, worked out once: `run` fills a copy of
        the weights-only argument list (walking ~300 inputs by role took 0.2 ms a step)."""
        args, step, pools, adapters = [], [], [], []
        for i, spec in enumerate(entry.program.inputs):
            if spec.role in CALL_ROLES:
                step.append((i, spec, numpy_dtype(spec.dtype)))
                args.append(None)
            elif spec.role in POOL_IN_ROLES:
                pools.append((i, spec.pool))
                args.append(None)
            elif spec.role == LORA_POOL:  # read where it lies; replaced when a slot is written
                adapters.append((i, spec.pool))
                args.append(None)
            elif spec.role == WEIGHT:
                args.append(self.weights[spec.slot])
            else:
                raise AssertionError(spec.role)
        outputs = [(spec.role, spec.pool) for spec in entry.program.outputs]
        returns = frozenset(role for role, _ in outputs if role not in POOL_OUT_ROLES)
        return _CallPlan(args, step, pools, outputs, returns, adapters)

    # ---------------------------------------------------------------- run

    @staticmethod
    def _step_input_error(entry_name: str, spec, a) -> StepInputError:
        if a is None:
            return StepInputError(f"entry {entry_name}: step input {spec.role} is missing")
        got = f"{getattr(a, 'dtype', type(a).__name__)} {list(getattr(a, 'shape', []))}"
        return StepInputError(f"entry {entry_name}: {spec.role} must be {spec.dtype} "
                              f"{list(spec.shape)}, got {got}")

    def run(self, entry_name: str, step: dict[str, np.ndarray]) -> np.ndarray:
        """Run a decode or prefill entry; returns the logits [batch, vocab] as a host copy. The
        pools are donated and replaced by the entry's updated pools."""
        return self._execute(entry_name, step, (LOGITS,))[0]

    def run_positions(self, entry_name: str, step: dict[str, np.ndarray],
                      logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Run a verify entry; returns host copies of the argmax after every position
        [batch, tokens] (i32) and, only when `logits`, of the logits after every position
        [batch, tokens, vocab] (otherwise None: that buffer is dropped on the device, never
        copied). The pools are donated and replaced as by `run`."""
        roles = (POSITION_ARGMAX, POSITION_LOGITS) if logits else (POSITION_ARGMAX,)
        outs = self._execute(entry_name, step, roles)
        return outs[0], (outs[1] if logits else None)

    def _execute(self, entry_name: str, step: dict[str, np.ndarray],
                 roles: tuple[str, ...]) -> list[np.ndarray]:
        """Run an entry: the step inputs checked and put on the device, the pools donated and
        replaced by its outputs; returns host copies of the outputs of `roles`, in that order
        (every other output that is not a pool is dropped on the device)."""
        exe = self.executables.get(entry_name)
        if exe is None:
            raise StepInputError(f"entry {entry_name} was not compiled in this runtime")
        plan = self._plans[entry_name]
        counted = self.expert_load is not None and EXPERT_LOAD in plan.returns
        roles = roles + (EXPERT_LOAD,) if counted else roles
        missing = [r for r in roles if r not in plan.returns]
        if missing:
            kind = self.artifact.entries[entry_name].kind
            raise StepInputError(f"entry {entry_name} is a {kind} entry: it has no "
                                 f"{', '.join(missing)} output")
        # The pools' addresses, for the donation check (not counted in the step's phases).
        check = (self.check_every_run or self.donation.runs < CHECKED_RUNS
                 or entry_name not in self.donation.entries_checked)
        before = ({pool: self.device.addresses(self.pools[pool]) for _, pool in plan.pools}
                  if check else None)
        t_start = time.perf_counter()
        args = list(plan.args)
        for i, spec, dtype in plan.step:
            # Shape and dtype of every step input against the program; PJRT checks only bytes.
            a = step.get(spec.role)
            if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != spec.shape:
                raise self._step_input_error(entry_name, spec, a)
            args[i] = self.device.put(a)
        for i, pool in plan.pools:
            args[i] = self.pools[pool]
        for i, pool in plan.adapters:
            args[i] = self.adapters.values[pool]
        t_inputs = time.perf_counter()
        outs = self.device.execute(exe, args)
        del args
        wanted = {}
        for (role, pool), out in zip(plan.outputs, outs):
            if role in POOL_OUT_ROLES:
                self.pools[pool] = out
            elif role in roles:
                wanted[role] = out
        del outs  # outputs not asked for go with it, never copied to the host
        # (a tensor-parallel program's logits are replicated: device 0's copy is read)
        buffers = [self.device.first(wanted[r]) for r in roles]
        self.device.wait(buffers[0])  # execution is asynchronous: the executable ends here
        t_executed = time.perf_counter()
        host = [self.device.read(b) for b in buffers]  # copies: no view of a buffer is kept
        del buffers, wanted
        if counted:
            self.expert_load += host.pop()
        phases = self.phase_seconds
        phases["inputs"] += t_inputs - t_start
        phases["execute"] += t_executed - t_inputs
        phases["copy"] += time.perf_counter() - t_executed
        self._count_donation(entry_name, before)
        return host

    def _count_donation(self, entry_name: str, before: dict[str, int] | None) -> None:
        """One more run; with `before` (the pools' addresses when it was checked), whether its
        pools stayed in place, logged over the first runs and at each entry's first run."""
        self.donation.runs += 1
        if before is None:
            return
        moved = sum(before[p] != self.device.addresses(self.pools[p]) for p in before)
        self.donation.checked_runs += 1
        if moved:
            self.donation.copied += 1
        else:
            self.donation.in_place += 1
        if self.donation.checked_runs == CHECKED_RUNS:
            d = self.donation
            log.info("KV pools over the first %d runs: in place %d/%d, copied %d/%d",
                     CHECKED_RUNS, d.in_place, d.checked_runs, d.copied, d.checked_runs)
        if entry_name not in self.donation.entries_checked:
            self.donation.entries_checked.add(entry_name)
            log.info("entry %s first run: pools %s", entry_name,
                     "in place" if not moved else f"copied ({moved} moved)")

    def pool_snapshot(self, name: str) -> np.ndarray:
        """A host copy of one pool (tests): never a view, which would stop donation. A split
        pool's shards are joined as the program sees it (device 0's heads first)."""
        return self.device.host(self.pools[name], self.artifact.pool_axis(name))

    def layer_kv_snapshot(self, layer: int, kind: str) -> np.ndarray:
        """A host copy of one layer's K or V pages, [pages, block, heads, d] (tests), from its
        own pool or from the stacked pool of the layer loop."""
        for p in self.artifact.pools:
            stacked = p.stacked_layers > 1 and p.layer <= layer < p.layer + p.stacked_layers
            if p.kind == kind and stacked:
                return self.pool_snapshot(p.name)[:, layer - p.layer].copy()
        return self.pool_snapshot(f"l{layer}.{kind}")

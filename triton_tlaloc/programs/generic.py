"""Generic StableHLO programs (docs/design.md#generic-programs): a program that is not a
language model, whose `@main` arguments are bound to Triton inputs, weight files or pieces of
per-instance state, and whose results are bound to Triton outputs or back to that state.

    arguments  "input:X,weight:weights/w.bin,state:total"   one binding per @main argument
    results    "output:Y,state:total"                       one binding per @main result

A program may have dynamic dimensions (`tensor<?x4xf32>`, as `jax.export` writes them for
symbolic shapes). Each set of concrete input shapes gets its own executable: `specialize`
wraps the program in a `@main` of those static types and runs StableHLO's shape refinement
(the pass JAX runs before compiling an exported function), so any StableHLO a user brings can
be served at the shapes its requests have. A state argument is donated to its result (the
alias is set here, from the bindings, whatever the program says), so the state stays on the
device where it was allocated and is updated in place; the runtime checks the address.

Stateless programs may be batched: `plan_groups` decides which requests run together (the
requests of one row shape, or with group_by_shape false only consecutive requests of one row
shape: the control), `run_batch` stacks their rows, pads the batch to a power of two
(so each row shape compiles a handful of batch sizes, not one per count of rows), runs once and
slices each request's rows back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifact.manifest import numpy_dtype
from ..artifact.stablehlo import ProgramError, Signature, TensorType, read_signature, specialize

log = logging.getLogger("triton_tlaloc.programs.generic")

ARGUMENT_KINDS = ("input", "weight", "state")
RESULT_KINDS = ("output", "state")

# StableHLO element types and Triton's data types (the ones both have).
TRITON_TYPES = {"i1": "TYPE_BOOL", "i8": "TYPE_INT8", "i16": "TYPE_INT16", "i32": "TYPE_INT32",
                "i64": "TYPE_INT64", "ui8": "TYPE_UINT8", "ui16": "TYPE_UINT16",
                "ui32": "TYPE_UINT32", "ui64": "TYPE_UINT64", "f16": "TYPE_FP16",
                "bf16": "TYPE_BF16", "f32": "TYPE_FP32", "f64": "TYPE_FP64"}


def fits(t: TensorType, a: np.ndarray, any_rows: bool = False) -> bool:
        """Whether `a` has the type `t`; with any_rows, whatever its leading axis (a batch)."""
        skip = 1 if any_rows else 0
        return (a.dtype == numpy_dtype(t.dtype) and a.ndim == len(t.dims)
                and all(d is None or d == n for d, n in zip(t.dims[skip:], a.shape[skip:])))


# ------------------------------------------------------------------ bindings

@dataclass(frozen=True)
class Binding:
    kind: str  # input | weight | state (arguments); output | state (results)
    name: str  # the Triton tensor's name, the weight file, the state's name

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def parse_bindings(text: str, kinds: tuple[str, ...], what: str) -> list[Binding]:
    """'input:X,weight:w.bin,state:s' -> bindings, checked by name."""
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        kind, sep, name = part.partition(":")
        if not sep or kind not in kinds or not name:
            raise ProgramError(f"{what} {i} ({part!r}): expected KIND:NAME with KIND one of "
                               f"{', '.join(kinds)}")
        out.append(Binding(kind, name))
    tensors = [b.name for b in out if b.kind in ("input", "output")]
    for name in set(tensors):
        if tensors.count(name) > 1:
            raise ProgramError(f"{what}: {name} is bound twice")
    return out


def format_bindings(bindings: list[Binding]) -> str:
    return ",".join(str(b) for b in bindings)


# ------------------------------------------------------------------ grouping (pure)

def plan_groups(keys: list, group_by_shape: bool) -> list[list[int]]:
    """Which requests run together, in order of each group's first request. With
    group_by_shape, every request of one key (its rows' shapes) joins one group; without it,
    only a run of consecutive requests of one key does (the control)."""
    groups: list[list[int]] = []
    by_key: dict = {}
    for i, key in enumerate(keys):
        if group_by_shape:
            if key not in by_key:
                by_key[key] = len(groups)
                groups.append([])
            groups[by_key[key]].append(i)
        elif groups and keys[groups[-1][-1]] == key:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def batch_bucket(rows: int, max_batch: int) -> int:
    """The batch a group of `rows` rows runs at: the next power of two, at most max_batch."""
    assert 1 <= rows <= max_batch, (rows, max_batch)
    return min(1 << (rows - 1).bit_length(), max_batch)


# ------------------------------------------------------------------ the runtime

@dataclass
class StateStats:
    in_place: int = 0
    copied: int = 0


def check_bindings(sig: Signature, args: list[Binding], res: list[Binding], weights_root: Path,
                   load: bool = True) -> dict[int, np.ndarray]:
    """Refuse by name bindings that do not fit @main (counts, element types, static shapes
    for weights and state, each state one argument and one result of one type, weight files
    and their sizes); returns the weights by argument index (read when `load`)."""
    if len(args) != len(sig.inputs):
        raise ProgramError(f"@main takes {len(sig.inputs)} arguments "
                           f"({', '.join(map(str, sig.inputs))}); the arguments parameter "
                           f"binds {len(args)}")
    if len(res) != len(sig.results):
        raise ProgramError(f"@main returns {len(sig.results)} results "
                           f"({', '.join(map(str, sig.results))}); the results parameter "
                           f"binds {len(res)}")
    for i, (b, t) in enumerate(zip(args, sig.inputs)):
        if t.dtype not in TRITON_TYPES:
            raise ProgramError(f"argument {i} ({b}): element type {t.dtype} has no Triton "
                               f"data type")
        if b.kind in ("weight", "state") and not t.static:
            raise ProgramError(f"argument {i} ({b}) is {t}: a {b.kind} needs a static shape")
    for i, (b, t) in enumerate(zip(res, sig.results)):
        if t.dtype not in TRITON_TYPES:
            raise ProgramError(f"result {i} ({b}): element type {t.dtype} has no Triton "
                               f"data type")
    arg_states = [(i, b.name) for i, b in enumerate(args) if b.kind == "state"]
    res_states = [(i, b.name) for i, b in enumerate(res) if b.kind == "state"]
    for names, other, what in ((arg_states, res_states, "result"),
                               (res_states, arg_states, "argument")):
        for i, name in names:
            match = [j for j, n in other if n == name]
            if len(match) != 1:
                raise ProgramError(f"state {name}: needs exactly one {what} bound to it, "
                                   f"found {len(match)}")
    for i, name in arg_states:
        j = next(j for j, n in res_states if n == name)
        if sig.inputs[i] != sig.results[j]:
            raise ProgramError(f"state {name}: argument {i} is {sig.inputs[i]} but result "
                               f"{j} is {sig.results[j]}")
    weights = {}
    for i, b in enumerate(args):
        if b.kind != "weight":
            continue
        if Path(b.name).is_absolute() or ".." in Path(b.name).parts:
            raise ProgramError(f"argument {i} ({b}): a weight file is named relative to the "
                               f"program's directory, inside it (it is linked or copied into "
                               f"the model's version directory under that name)")
        t, path = sig.inputs[i], weights_root / b.name
        if not path.is_file():
            raise ProgramError(f"argument {i} ({b}): no such file {path}")
        dtype = numpy_dtype(t.dtype)
        if path.suffix == ".npy":
            a = np.load(path, mmap_mode=None if load else "r")
        else:  # raw little-endian bytes in the program's shape, as an artifact's weights
            want = int(np.prod(t.dims)) * dtype.itemsize
            if path.stat().st_size != want:
                raise ProgramError(f"argument {i} ({b}): {path.stat().st_size} bytes, "
                                   f"{t} needs {want}")
            if not load:
                continue
            a = np.fromfile(path, dtype=dtype).reshape(t.dims)
        if not fits(t, a):
            raise ProgramError(f"argument {i} ({b}): {a.dtype} {list(a.shape)} in the "
                               f"file, the program takes {t}")
        weights[i] = a
    return weights


class ProgramRuntime:
    """A generic program on one device: weights uploaded once, state allocated once (zeros)
    and donated to every execution, one executable per set of input shapes."""

    def __init__(self, program: str | Path, arguments: list[Binding], results: list[Binding], *,
                 platform: str = "cpu", device_index: int = 0, weights_root: Path | None = None,
                 donate_state: bool = True, cache_dir: Path | None = None):
        from ..runtime.pjrt import PjrtDevice
        from ..runtime.compile_cache import default_cache_dir

        self.program = Path(program)
        self.text = self.program.read_text()
        self.signature = sig = read_signature(self.text)
        self.arguments, self.results = arguments, results
        weights = check_bindings(sig, arguments, results, weights_root or self.program.parent)
        self.device = PjrtDevice(platform, device_index)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.donate_state = donate_state
        self.inputs = {b.name: (i, sig.inputs[i]) for i, b in enumerate(arguments)
                       if b.kind == "input"}
        self.outputs = {b.name: (i, sig.results[i]) for i, b in enumerate(results)
                        if b.kind == "output"}
        state_results = {b.name: i for i, b in enumerate(results) if b.kind == "state"}
        self.aliases = ({i: state_results[b.name] for i, b in enumerate(arguments)
                         if b.kind == "state"} if donate_state else {})
        self.fixed: dict[int, object] = {}  # argument index -> device buffer (weights, state)
        t0 = time.perf_counter()
        for i, b in enumerate(arguments):
            if b.kind == "weight":
                self.fixed[i] = self.device.put(weights[i])
        self.weight_bytes = sum(a.nbytes for a in weights.values())
        state_args = [i for i, b in enumerate(arguments) if b.kind == "state"]
        if state_args:
            zeros = self.device.zeros([(sig.inputs[i].dims, numpy_dtype(sig.inputs[i].dtype))
                                       for i in state_args])
            self.fixed.update(zip(state_args, zeros))
        self.state_args = {arguments[i].name: i for i in state_args}
        self.state_results = state_results
        self.state_bytes = sum(int(np.prod(sig.inputs[i].dims)) *
                               numpy_dtype(sig.inputs[i].dtype).itemsize for i in state_args)
        self.state = StateStats()
        self.executables: dict[tuple, object] = {}
        self.executions = 0
        self.compiles = 0
        self._lock = threading.Lock()
        log.info("program %s: %d arguments (%d inputs, %d weights %.1f KiB, %d states %.1f "
                 "KiB, state %s), %d results; loaded in %.2f s", self.program.name,
                 len(arguments), len(self.inputs), len(arguments) - len(self.inputs)
                 - len(state_args), self.weight_bytes / 1024, len(state_args),
                 self.state_bytes / 1024, "donated" if donate_state else "copied (control)",
                 len(results), time.perf_counter() - t0)
        if all(t.static for t in sig.inputs):
            self.executable(tuple(t.dims for t in sig.inputs))

    @property
    def stateful(self) -> bool:
        return bool(self.state_args)

    def input_error(self, arrays: dict[str, np.ndarray], any_rows: bool = False) -> str | None:
        """Why these inputs cannot run (named), or None; with any_rows the leading axes are not
        checked (a request's rows, stacked and padded to the program's batch later)."""
        for name, (i, t) in self.inputs.items():
            if name not in arrays:
                return f"input {name} is missing"
            a = arrays[name]
            if not fits(t, a, any_rows):
                return f"input {name} must be {t}, got {a.dtype} {list(a.shape)}"
        return None

    def executable(self, shapes: tuple):
        from ..runtime.compile_cache import compile_cached

        with self._lock:
            exe = self.executables.get(shapes)
            if exe is None:
                at = ", ".join(f"{b.name}{list(s)}" for b, s in zip(self.arguments, shapes)
                               if b.kind == "input")
                try:
                    text = specialize(self.text, list(shapes), self.aliases)
                except ProgramError as e:
                    raise ProgramError(
                        f"inputs {at} do not fit the program's shapes (@main takes "
                        f"{', '.join(map(str, self.signature.inputs))}): {e}") from None
                exe = compile_cached(self.device, text, f"program {self.program.name} at {at}",
                                     self.cache_dir)
                self.executables[shapes] = exe
                self.compiles += 1
            return exe

    def precompile_batches(self, max_batch: int) -> int:
        """Compile every batch bucket up to max_batch now, when the inputs' rows have static
        shapes (only the batch axis is dynamic): the first requests then wait for no compile.
        Returns how many shapes were compiled (0 when a row dimension is dynamic)."""
        types = [t for _, t in self.inputs.values()]
        if not types or any(not t.dims or t.dims[0] is not None  # a static batch: compiled
                            or not all(d is not None for d in t.dims[1:]) for t in types):
            return 0
        buckets = sorted({batch_bucket(n, max_batch) for n in range(1, max_batch + 1)})
        before = self.compiles
        for n in buckets:
            self.executable(tuple((n,) + t.dims[1:] if b.kind == "input" else t.dims
                                  for b, t in zip(self.arguments, self.signature.inputs)))
        return self.compiles - before

    def run(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One execution; returns the outputs by name (host copies). The state is replaced by
        the results bound to it (written over it when donated)."""
        problem = self.input_error(arrays)
        if problem:
            raise ProgramError(problem)
        shapes = tuple(tuple(arrays[b.name].shape) if b.kind == "input" else self.signature
                       .inputs[i].dims for i, b in enumerate(self.arguments))
        exe = self.executable(shapes)
        args = [self.fixed[i] if i in self.fixed else self.device.put(
            np.ascontiguousarray(arrays[b.name])) for i, b in enumerate(self.arguments)]
        before = {i: self.fixed[i].unsafe_buffer_pointer() for i in self.state_args.values()}
        outs = self.device.execute(exe, args)
        self.executions += 1
        for name, i in self.state_args.items():
            self.fixed[i] = outs[self.state_results[name]]
            if self.fixed[i].unsafe_buffer_pointer() == before[i]:
                self.state.in_place += 1
            else:
                self.state.copied += 1
        return {name: np.asarray(outs[j]) for name, (j, _) in self.outputs.items()}

    def state_value(self, name: str) -> np.ndarray:
        """A host copy of one state (tests, verify)."""
        return np.array(self.fixed[self.state_args[name]])


def run_batch(runtime: ProgramRuntime, requests: list[dict[str, np.ndarray]], *,
              group_by_shape: bool, max_batch: int) -> list:
    """Stateless requests batched by Triton (each input [rows, ...]): grouped by the shape of
    their rows, each group stacked, padded to its batch bucket and run once. Returns, per
    request, its outputs by name or the ProgramError that refused it."""
    answers: list = [None] * len(requests)
    keys = []
    for r, arrays in enumerate(requests):
        rows = {a.shape[0] if a.ndim else None for a in arrays.values()}
        if len(rows) != 1 or None in rows or 0 in rows:
            answers[r] = ProgramError(f"every input of a request needs the same leading batch "
                                      f"axis of at least one row, got shapes "
                                      f"{[list(a.shape) for a in arrays.values()]}")
            keys.append(("refused", r))
            continue
        problem = runtime.input_error(arrays, any_rows=True)  # the batch is padded later
        if problem:
            answers[r] = ProgramError(problem)
            keys.append(("refused", r))
            continue
        keys.append(tuple((name, arrays[name].shape[1:]) for name in runtime.inputs))
    for group in plan_groups(keys, group_by_shape):
        if answers[group[0]] is not None:
            continue
        rows = [next(iter(requests[r].values())).shape[0] for r in group]
        total = sum(rows)
        fixed = next(iter(runtime.inputs.values()))[1].dims[0]  # a program of a static batch
        if fixed is not None and total > fixed:
            for r in group:
                answers[r] = ProgramError(f"{total} rows: the program's batch is {fixed}")
            continue
        bucket = fixed if fixed is not None else batch_bucket(total, max(max_batch, total))
        stacked = {}
        for name in runtime.inputs:
            parts = [requests[r][name] for r in group]
            pad = bucket - total
            if pad:
                parts.append(np.zeros((pad,) + parts[0].shape[1:], parts[0].dtype))
            stacked[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        try:
            outs = runtime.run(stacked)
        except ProgramError as e:
            for r in group:
                answers[r] = e
            continue
        bad = [n for n, o in outs.items() if o.ndim == 0 or o.shape[0] != bucket]
        if bad:
            e = ProgramError(f"output {bad[0]} has shape {list(outs[bad[0]].shape)}: a batched "
                             f"program's outputs need the batch ({bucket}) as their first axis")
            for r in group:
                answers[r] = e
            continue
        start = 0
        for r, n in zip(group, rows):
            answers[r] = {name: o[start:start + n] for name, o in outs.items()}
            start += n
    return answers


def export_program(fn, inputs: list, out: str | Path, donate: tuple[str, ...] = ()) -> Path:
    """Write `fn(*inputs)` as StableHLO text at `out` (jax.export). `inputs` are
    bounded.TensorShape specs; a dimension given as a name is symbolic (`?` in the program,
    one name one size), so the program serves any size there. Arguments named in `donate` are
    aliased to their results (the backend sets the aliases of state bindings itself)."""
    import jax
    from jax import export

    from ..runtime.pjrt import x64_mode

    names = list(dict.fromkeys(d for s in inputs for d in s.dims if isinstance(d, str)))
    symbols = dict(zip(names, export.symbolic_shape(", ".join(names)))) if names else {}
    wide = any(numpy_dtype(s.dtype).itemsize == 8 for s in inputs)
    with x64_mode(wide):
        specs = [jax.ShapeDtypeStruct(tuple(symbols[d] if isinstance(d, str) else d
                                            for d in s.dims), numpy_dtype(s.dtype))
                 for s in inputs]
        donate_argnums = tuple(i for i, s in enumerate(inputs) if s.name in donate)
        exported = export.export(jax.jit(fn, donate_argnums=donate_argnums))(*specs)
        text = exported.mlir_module()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out

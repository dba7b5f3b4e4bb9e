"""Bounded programs (docs/design.md#bounded-programs; schema tlaloc-bounded-v1): a JAX
function whose inputs have axes of a size known only at run time, at most a bound.

`export_bounded` writes one StableHLO body per bucket of each bound (powers of two up to the
bound by default), each taking the inputs padded to its bucket plus, for each bound B, a valid
mask `B_mask` (bool [bucket]) and a valid length `B_len` (i32 []). It refuses a function whose
padded result differs from its exact-size result. `BoundedRuntime` pads a request to the
smallest bucket that holds it, fills the mask and length, runs, and slices each output's
bounded axes back to the valid length.

    tlaloc-bounded.json     {"schema": "tlaloc-bounded-v1", "bounds", "inputs", "outputs",
                             "entries": [{"name", "buckets", "body", "sha256", "program"}]}
    bodies/<sha256>.mlir    @main(inputs..., masks and lengths in bound order) -> outputs
    programs/<name>.json    each entry's parameter and result types

A dimension of an input or output spec is an int or the name of a bound.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifact.manifest import ArtifactError, numpy_dtype

BOUNDED_MANIFEST = "tlaloc-bounded.json"
SCHEMA_BOUNDED_V1 = "tlaloc-bounded-v1"


class BoundedError(ValueError):
    """A bounded export or request refused; the message names the problem."""


@dataclass(frozen=True)
class TensorShape:
    name: str
    dtype: str  # StableHLO element type: f32, i32, ...
    dims: tuple  # ints, or bound names

    def at(self, buckets: dict[str, int]) -> tuple[int, ...]:
        return tuple(buckets[d] if isinstance(d, str) else int(d) for d in self.dims)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}

    @staticmethod
    def from_json(obj: dict) -> "TensorShape":
        return TensorShape(obj["name"], obj["dtype"], tuple(obj["dims"]))


def default_buckets(bound: int) -> list[int]:
    """Powers of two up to the bound, and the bound itself."""
    return sorted({2 ** k for k in range(bound.bit_length()) if 2 ** k <= bound} | {bound})


def _extra_args(bounds: dict[str, int], buckets: dict[str, int], lengths: dict[str, int]):
    """Each bound's valid mask and valid length, in bound order."""
    out = []
    for b in bounds:
        out.append(np.arange(buckets[b]) < lengths[b])
        out.append(np.int32(lengths[b]))
    return out


def _call(fn, inputs: list[TensorShape], bounds: dict[str, int], arrays, buckets, lengths):
    kwargs = {s.name: a for s, a in zip(inputs, arrays)}
    extra = _extra_args(bounds, buckets, lengths)
    for i, b in enumerate(bounds):
        kwargs[f"{b}_mask"], kwargs[f"{b}_len"] = extra[2 * i], extra[2 * i + 1]
    out = fn(**kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def export_bounded(fn, inputs: list[TensorShape], bounds: dict[str, int], out: str | Path,
                   buckets: dict[str, list[int]] | None = None, check_lengths: int = 3,
                   rtol: float = 1e-6, seed: int = 0) -> Path:
    """Write a tlaloc-bounded-v1 artifact of `fn(**inputs, **{B_mask, B_len})` at `out`.

    Before writing, each bucket is checked: for `check_lengths` valid lengths in the bucket
    (its smallest, largest and one between), random inputs run padded to the bucket must give,
    sliced, the result the same inputs give at their exact size (within rtol of the largest
    value); a function that reads its padding is refused by name. 64-bit inputs are lowered
    with JAX's x64 mode on (it truncates them to 32 bits otherwise)."""
    from ..runtime.pjrt import x64_mode

    wide = any(numpy_dtype(s.dtype).itemsize == 8 for s in inputs)
    with x64_mode(wide):
        return _export_bounded(fn, inputs, bounds, Path(out), buckets, check_lengths, rtol, seed)


def _export_bounded(fn, inputs, bounds, out: Path, buckets, check_lengths, rtol, seed) -> Path:
    import jax

    for s in inputs:
        for d in s.dims:
            if isinstance(d, str) and d not in bounds:
                raise BoundedError(f"input {s.name}: axis {d!r} is not a declared bound")
    buckets = {b: sorted(buckets[b]) if buckets and b in buckets else default_buckets(m)
               for b, m in bounds.items()}
    for b, m in bounds.items():
        if max(buckets[b]) < m:
            raise BoundedError(f"bound {b}: buckets {buckets[b]} do not reach its maximum {m}")
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "bodies").mkdir()
        (tmp / "programs").mkdir()
        entries, outputs = [], []
        for combo in itertools.product(*(buckets[b] for b in bounds)):
            at = dict(zip(bounds, combo))
            specs = [jax.ShapeDtypeStruct(s.at(at), numpy_dtype(s.dtype)) for s in inputs]
            specs += [jax.ShapeDtypeStruct(x.shape, x.dtype)
                      for x in _extra_args(bounds, at, at)]

            def positional(*args, at=at):
                named = {s.name: a for s, a in zip(inputs, args)}
                for i, b in enumerate(bounds):
                    named[f"{b}_mask"], named[f"{b}_len"] = args[len(inputs) + 2 * i], \
                        args[len(inputs) + 2 * i + 1]
                res = fn(**named)
                return tuple(res) if isinstance(res, (tuple, list)) else (res,)

            lowered = jax.jit(positional, keep_unused=True).lower(*specs)  # every parameter
            results = jax.eval_shape(positional, *specs)
            # the largest buckets come last: they name each output's bounded axes
            outputs = _output_shapes(results, bounds, at)
            _check_padding(fn, inputs, bounds, at, buckets, check_lengths, rtol, rng)
            text = lowered.as_text()
            sha = hashlib.sha256(text.encode()).hexdigest()
            name = "bounded_" + "_".join(f"{b}{n}" for b, n in at.items())
            (tmp / "bodies" / f"{sha}.mlir").write_text(text)
            program = {"entry": name, "buckets": at,
                       "inputs": [{"name": s.name, "dtype": s.dtype, "shape": list(s.at(at))}
                                  for s in inputs]
                       + [{"name": f"{b}_{k}", "dtype": dt, "shape": shape}
                          for b in bounds for k, dt, shape in (("mask", "i1", [at[b]]),
                                                               ("len", "i32", []))],
                       "outputs": [{"name": f"output_{i}", "dtype": r.dtype.name,
                                    "shape": list(r.shape)} for i, r in enumerate(results)]}
            (tmp / "programs" / f"{name}.json").write_text(json.dumps(program, indent=1))
            entries.append({"name": name, "buckets": at, "body": f"bodies/{sha}.mlir",
                            "sha256": sha, "program": f"programs/{name}.json"})
        manifest = {"schema": SCHEMA_BOUNDED_V1, "exporter": "triton-tlaloc",
                    "bounds": {b: {"max": m, "buckets": buckets[b]} for b, m in bounds.items()},
                    "inputs": [s.to_json() for s in inputs],
                    "outputs": [o.to_json() for o in outputs], "entries": entries}
        (tmp / BOUNDED_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        load_bounded(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _output_shapes(results, bounds, at) -> list[TensorShape]:
    """Each output's dims at the largest buckets `at`: an axis of a bound's size is that
    bound's, sliced to the valid length at run time."""
    from ..artifact.manifest import dtype_name

    outs = []
    for i, r in enumerate(results):
        dims = []
        for j, d in enumerate(r.shape):
            named = [b for b in bounds if at[b] == d and at[b] > 1]
            if len(named) > 1:
                raise BoundedError(f"output {i} axis {j}: size {d} could be bound "
                                   f"{' or '.join(named)}: give the bounds different maxima")
            dims.append(named[0] if named else int(d))
        outs.append(TensorShape(f"output_{i}", dtype_name(r.dtype), tuple(dims)))
    return outs


def _check_padding(fn, inputs, bounds, at, buckets, check_lengths, rtol, rng):
    """Refuse a function whose result, run padded to bucket `at`, differs from its exact-size
    result (after slicing)."""
    import jax

    lows = {b: max([x for x in buckets[b] if x < at[b]], default=0) + 1 for b in bounds}
    for pick in range(check_lengths):
        lengths = {}
        for b in bounds:
            lo, hi = lows[b], at[b]
            lengths[b] = (lo, hi, (lo + hi) // 2)[pick % 3]
        exact = [rng.standard_normal(s.at(lengths)).astype(numpy_dtype(s.dtype))
                 if np.issubdtype(numpy_dtype(s.dtype), np.floating)
                 else rng.integers(0, 8, s.at(lengths)).astype(numpy_dtype(s.dtype))
                 for s in inputs]
        padded = [_pad(a, s, lengths, at, fill=rng) for a, s in zip(exact, inputs)]
        want = _call(fn, inputs, bounds, exact, lengths, lengths)
        got = _call(fn, inputs, bounds, padded, at, lengths)
        for i, (w, g) in enumerate(zip(jax.device_get(want), jax.device_get(got))):
            # compared in f64 (bool and small integers too)
            g = np.asarray(g)[tuple(slice(0, n) for n in np.shape(w))].astype(np.float64)
            w = np.asarray(w).astype(np.float64)
            scale = max(1.0, float(np.max(np.abs(w))) if w.size else 1.0)
            if g.shape != w.shape or float(np.max(np.abs(g - w), initial=0.0)) > rtol * scale:
                raise BoundedError(
                    f"output {i} at lengths {lengths} padded to buckets {at} differs from its "
                    f"exact-size result: the function reads its padding (use the "
                    f"{', '.join(f'{b}_mask / {b}_len' for b in bounds)} inputs)")


def _pad(a: np.ndarray, spec: TensorShape, lengths, at, fill=None) -> np.ndarray:
    """`a` (at `lengths`) padded to `at` along its bounded axes. The exporter's check fills the
    padding with noise (a function must not read it); the runtime pads with zeros."""
    target = spec.at(at)
    if fill is None:
        out = np.zeros(target, a.dtype)
    elif np.issubdtype(a.dtype, np.floating):
        out = (fill.standard_normal(target) * 1e3).astype(a.dtype)
    else:
        out = fill.integers(0, 100, target).astype(a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


# ------------------------------------------------------------------ loading and running

@dataclass
class BoundedArtifact:
    path: Path
    bounds: dict[str, dict]
    inputs: list[TensorShape]
    outputs: list[TensorShape]
    entries: list[dict]


def load_bounded(path: str | os.PathLike) -> BoundedArtifact:
    root = Path(path)
    mpath = root / BOUNDED_MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"not a bounded-program artifact: no {BOUNDED_MANIFEST} ({mpath})")
    m = json.loads(mpath.read_text())
    if m.get("schema") != SCHEMA_BOUNDED_V1:
        raise ArtifactError(f"schema {m.get('schema')!r}: this runtime serves "
                            f"{SCHEMA_BOUNDED_V1} ({mpath})")
    for e in m["entries"]:
        body = root / e["body"]
        if not body.is_file():
            raise ArtifactError(f"entry {e['name']}: file is missing ({body})")
        if hashlib.sha256(body.read_bytes()).hexdigest() != e["sha256"]:
            raise ArtifactError(f"entry {e['name']}: body sha256 differs from the manifest's "
                                f"({body})")
    return BoundedArtifact(root, m["bounds"], [TensorShape.from_json(s) for s in m["inputs"]],
                           [TensorShape.from_json(s) for s in m["outputs"]], m["entries"])


class BoundedRuntime:
    """A bounded artifact on one device: requests padded to the smallest bucket that holds them."""

    def __init__(self, artifact: str | os.PathLike | BoundedArtifact, platform: str = "cpu",
                 cache_dir: Path | None = None, device_index: int = 0):
        from ..runtime.pjrt import PjrtDevice
        from ..runtime.compile_cache import compile_cached, default_cache_dir

        self.art = artifact if isinstance(artifact, BoundedArtifact) else load_bounded(artifact)
        self.device = PjrtDevice(platform, device_index)
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.executables = {
            tuple(e["buckets"][b] for b in self.art.bounds): compile_cached(
                self.device, (self.art.path / e["body"]).read_text(), f"entry {e['name']}",
                cache) for e in self.art.entries}
        self.executions = 0

    def lengths_of(self, arrays: dict[str, np.ndarray]) -> dict[str, int]:
        """Each bound's length in this request, checked against the specs and the bound."""
        lengths: dict[str, int] = {}
        for s in self.art.inputs:
            if s.name not in arrays:
                raise BoundedError(f"input {s.name} is missing")
            a = arrays[s.name]
            if a.dtype != numpy_dtype(s.dtype) or a.ndim != len(s.dims):
                raise BoundedError(f"input {s.name} must be {s.dtype} of {len(s.dims)} axes "
                                   f"{list(s.dims)}, got {a.dtype} {list(a.shape)}")
            for axis, (d, n) in enumerate(zip(s.dims, a.shape)):
                if isinstance(d, str):
                    if lengths.setdefault(d, n) != n:
                        raise BoundedError(f"input {s.name} axis {axis} ({d}) is {n}, another "
                                           f"input's is {lengths[d]}")
                    if not 1 <= n <= self.art.bounds[d]["max"]:
                        raise BoundedError(f"input {s.name} axis {axis} ({d}) is {n}, past its "
                                           f"bound {self.art.bounds[d]['max']}")
                elif n != d:
                    raise BoundedError(f"input {s.name} axis {axis} must be {d}, got {n}")
        return lengths

    def run(self, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        lengths = self.lengths_of(arrays)
        at = {b: min(x for x in v["buckets"] if x >= lengths[b]) for b, v in
              self.art.bounds.items()}
        args = [_pad(arrays[s.name], s, lengths, at) for s in self.art.inputs]
        args += _extra_args(self.art.bounds, at, lengths)
        exe = self.executables[tuple(at[b] for b in self.art.bounds)]
        outs = self.device.execute(exe, [self.device.put(np.asarray(a)) for a in args])
        self.executions += 1
        result = []
        for spec, o in zip(self.art.outputs, outs):
            o = np.array(o)
            result.append(o[tuple(slice(0, lengths[d]) if isinstance(d, str) else slice(None)
                                  for d in spec.dims)])
        return result

"""The adapter pools on the device (model.lora): one A and one B pool per adapted part,
[layers, slots, ...] f32, zeros at first (slot 0 stays zeros: no adapter). An adapter is
written into a slot by one program that takes every pool donated and updates that slot in
place (a dynamic update slice per pool), so loading an adapter moves its own bytes, not the
pools'. On one device that program is StableHLO text written here (`slot_write_text`: no JAX,
so the C API runtime writes slots too); over several it is lowered by JAX with the pools'
shardings. The entries read the pools as they are (never donated). Over several devices each
pool is held as the layout splits it (lora.layout: a column-parallel part's B by outputs, a
row-parallel part's A by inputs, the rest copied), and a slot's arrays are cut for each device
before they are written."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..artifact.sharding import mesh_sharding
from .compile_cache import CompileStats, compile_cached

log = logging.getLogger("triton_tlaloc.adapter_pools")


class AdapterPools:
    """A runtime's adapter pools, by name (lora.layout.LoraLayout.pool_shapes), and the slot
    writes."""

    def __init__(self, runtime, layout):
        self.rt = runtime
        self.layout = layout
        self.shapes = layout.pool_shapes()  # as an adapter's arrays are laid out
        self.splits = layout.pool_splits()
        self.values = dict(zip(self.shapes, runtime.device.zeros(
            [(shape, np.dtype(np.float32)) for shape in layout.shard_shapes().values()])))
        self.nbytes = sum(4 * int(np.prod(s)) for s in layout.program_shapes().values())
        self.compile_stats = CompileStats()
        self._program = None
        self._compiling = threading.Lock()
        self.writes = 0
        self.write_seconds = 0.0
        log.info("adapter pools: %d slots of rank up to %d (slot 0: none), %.1f MiB",
                 layout.slots - 1, layout.max_rank, self.nbytes / 2**20)

    def write(self, slot: int, arrays: dict[str, np.ndarray] | None) -> float:
        """Write an adapter's arrays (lora.peft_adapter.LoraAdapter.arrays: each pool's slot)
        into `slot`, or zeros (None: the slot cleared); the pools are donated and replaced.
        Returns the seconds it took."""
        assert 0 < slot < self.layout.slots, f"slot {slot}: slots are 1 .. {self.layout.slots - 1}"
        exe = self._write_program()
        device = self.rt.device
        t0 = time.perf_counter()
        rows = []
        for name, shape in self.shapes.items():
            a = (np.zeros((shape[0], *shape[2:]), np.float32) if arrays is None
                 else arrays[name])
            assert a.shape == (shape[0], *shape[2:]) and a.dtype == np.float32, name
            shards = self.layout.slot_shards(name, a)
            rows.append(device.put(np.ascontiguousarray(a)) if shards is None
                        else device.put_shards(shards))
        args = [*self.values.values(), device.put(np.int32(slot)), *rows]
        outs = device.execute(exe, args)
        del args
        for name, out in zip(self.shapes, outs):
            self.values[name] = out
        device.wait(device.first(outs[0]))
        seconds = time.perf_counter() - t0
        self.writes += 1
        self.write_seconds += seconds
        return seconds

    def warm(self) -> None:
        """Compile (or load from the compile cache) the slot write now, so the first sequence
        that names an adapter does not wait for it."""
        self._write_program()

    def _write_program(self):
        """The executable writing one slot of every pool, made on first use."""
        with self._compiling:
            if self._program is not None:
                return self._program
            shapes = self.layout.program_shapes()
            if self.layout.devices == 1:  # written as text: no JAX needed (the C API runtime)
                text = slot_write_text(list(shapes.values()))
            else:
                text = self._lower_split(shapes)
            self._program = compile_cached(self.rt.device, text,
                                           "adapter slot write", self.rt.cache_dir,
                                           self.rt.use_cache, self.compile_stats)
            return self._program

    def _lower_split(self, shapes: dict[str, tuple[int, ...]]) -> str:
        """The slot write for the layout's devices: each pool and its slot's arrays split
        along the pool's axis (an abstract mesh, as the entries are lowered), by JAX."""
        from .capi import CapiMesh, PluginError

        if isinstance(self.rt.device, CapiMesh):
            raise PluginError("LoRA adapters on several devices with the C API runtime: not "
                              "yet (their slot write is lowered by JAX)")
        import jax

        specs = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes.values()]
        rows = [jax.ShapeDtypeStruct((s[0], *s[2:]), np.float32) for s in shapes.values()]
        slot = jax.ShapeDtypeStruct((), np.int32)
        n = self.layout.devices
        axes = [self.splits[name].axis if name in self.splits else None for name in self.shapes]
        pools = [mesh_sharding(n, 4, a) for a in axes]
        slot_rows = [mesh_sharding(n, 3, None if a is None else a - 1) for a in axes]
        jitted = jax.jit(_write_slot, in_shardings=(pools, mesh_sharding(n, 0), slot_rows),
                         out_shardings=tuple(pools), donate_argnums=0)
        return jitted.trace(specs, slot, rows).lower(
            lowering_platforms=(jax.default_backend(),)).as_text()


def slot_write_text(shapes: list[tuple[int, ...]]) -> str:
    """StableHLO of the one-device slot write: for each pool [layers, slots, ...] (f32,
    donated: its output aliases it) a row [layers, ...] put at the slot (an in-range index:
    AdapterPools.write asserts it) by a dynamic update slice."""
    def ty(shape):
        return f"tensor<{'x'.join(map(str, shape))}xf32>"

    n = len(shapes)
    params = [f"%p{i}: {ty(s)} {{tf.aliasing_output = {i} : i32}}" for i, s in enumerate(shapes)]
    params.append("%slot: tensor<i32>")
    params += [f"%r{i}: {ty((s[0], *s[2:]))}" for i, s in enumerate(shapes)]
    body = ["    %zero = stablehlo.constant dense<0> : tensor<i32>"]
    for i, s in enumerate(shapes):
        row, one = ty((s[0], *s[2:])), ty((s[0], 1, *s[2:]))
        dims = ", ".join(str(d) for d in (0, *range(2, len(s))))
        starts = ", ".join(["%zero", "%slot"] + ["%zero"] * (len(s) - 2))
        body.append(f"    %u{i} = stablehlo.broadcast_in_dim %r{i}, dims = [{dims}] : "
                    f"({row}) -> {one}")
        body.append(f"    %o{i} = stablehlo.dynamic_update_slice %p{i}, %u{i}, {starts} : "
                    f"({ty(s)}, {one}, {', '.join(['tensor<i32>'] * len(s))}) -> {ty(s)}")
    results = ", ".join(ty(s) for s in shapes)
    body.append(f"    return {', '.join(f'%o{i}' for i in range(n))} : {results}")
    return ("module @adapter_slot_write {\n"
            f"  func.func public @main({', '.join(params)}) -> ({results}) {{\n"
            + "\n".join(body) + "\n  }\n}\n")


def _write_slot(pools, slot, rows):
    from jax import lax

    return tuple(lax.dynamic_update_index_in_dim(p, r, slot, axis=1)
                 for p, r in zip(pools, rows))


__all__ = ["AdapterPools", "slot_write_text"]

"""The adapter pools on the device (model.lora): one A and one B pool per adapted part,
[layers, slots, ...] f32, zeros at first (slot 0 stays zeros: no adapter). An adapter is
written into a slot by one program that takes every pool donated and updates that slot in
place (a dynamic update slice per pool), so loading an adapter moves its own bytes, not the
pools'. The entries read the pools as they are (never donated)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .pjrt import CompileStats, compile_cached

log = logging.getLogger("triton_tlaloc.adapter_pools")


class AdapterPools:
    """A runtime's adapter pools, by name (lora.layout.LoraLayout.pool_shapes), and the slot
    writes."""

    def __init__(self, runtime, layout):
        self.rt = runtime
        self.layout = layout
        self.shapes = layout.pool_shapes()
        self.values = dict(zip(self.shapes, runtime.device.zeros(
            [(shape, np.dtype(np.float32)) for shape in self.shapes.values()])))
        self.nbytes = sum(4 * int(np.prod(s)) for s in self.shapes.values())
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
            rows.append(device.put(np.ascontiguousarray(a)))
        args = [*self.values.values(), device.put(np.int32(slot)), *rows]
        outs = device.execute(exe, args)
        del args
        for name, out in zip(self.shapes, outs):
            self.values[name] = out
        device.first(outs[0]).block_until_ready()
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
            import jax

            specs = [jax.ShapeDtypeStruct(s, np.float32) for s in self.shapes.values()]
            rows = [jax.ShapeDtypeStruct((s[0], *s[2:]), np.float32)
                    for s in self.shapes.values()]
            lowered = jax.jit(_write_slot, donate_argnums=0).lower(
                specs, jax.ShapeDtypeStruct((), np.int32), rows)
            self._program = compile_cached(self.rt.device, lowered.as_text(),
                                           "adapter slot write", self.rt.cache_dir,
                                           self.rt.use_cache, self.compile_stats)
            return self._program


def _write_slot(pools, slot, rows):
    from jax import lax

    return tuple(lax.dynamic_update_index_in_dim(p, r, slot, axis=1)
                 for p, r in zip(pools, rows))


__all__ = ["AdapterPools"]

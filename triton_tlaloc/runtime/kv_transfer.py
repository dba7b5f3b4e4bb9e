"""Page transfer programs: a set of pages (full-history pages, ring pages, a state slot) copied
out of a runtime's pools to host memory, and written back into other pages with the pools
donated, so they are updated in place. The host tier of the KV cache is built on them: a
sequence swapped out is its pages' bytes on the host, swapped in anywhere free.

The programs are StableHLO per pool class and page-count bucket (a power of two: a set of n
pages runs in the smallest bucket that holds it, the rest padded), written here as text on one
device (`transfer_text`: no JAX, so the C API runtime has them too) and lowered by JAX with the
pools' shardings over several, and compiled as the entries are, through the on-disk compile cache (compile_cache.compile_cached): reads
gather the pages of every pool of a class at once; writes scatter them back with the pools
donated, padding indices pointing past the pool, which the scatter drops. Bytes are copied as
they are: f32, bf16 and fp8 pools come back bit for bit.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..kv.host_tier import HostPages
from ..kv.page_pools import FULL, STATE, WINDOWED
from ..artifact.manifest import dtype_name, numpy_dtype
from .pjrt import x64_mode
from .compile_cache import CompileStats, compile_cached
from ..artifact.sharding import mesh_sharding

log = logging.getLogger("triton_tlaloc.kv_transfer")


def transfer_buckets(artifact) -> dict[str, tuple[int, ...]]:
    """The page counts to compile per pool class: every power of two up to what one sequence
    can hold (its context's pages, its ring, its one state slot)."""
    full = artifact.max_context // artifact.model.block_size
    ring = artifact.windowed.ring_pages if artifact.windowed else 0
    return {FULL: _powers(full), WINDOWED: _powers(ring), STATE: (1,)}


def _powers(n: int) -> tuple[int, ...]:
    return tuple(1 << k for k in range(bucket(n).bit_length())) if n else ()


def bucket(n: int) -> int:
    """The smallest power of two that holds n (n >= 1)."""
    assert n >= 1, "a transfer of no pages"
    return 1 << (n - 1).bit_length()


def pool_specs(art) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every KV and state pool's (shape, numpy dtype) by name, as the device holds it: the
    manifest's shape, the programs' dtype (an f8 pool's bytes, manifest.BITS)."""
    held = art.pool_input_dtypes()
    return {p.name: (tuple(p.shape), numpy_dtype(held[p.name]))
            for p in (*art.pools, *art.state_pools)}


def pool_classes(art) -> dict[str, list[str]]:
    """The names of the pools of each pool class the artifact has (full, windowed, state)."""
    classes = {FULL: [p.name for p in art.pools if p.pool_class == "full"],
               WINDOWED: [p.name for p in art.pools if p.pool_class == "windowed"],
               STATE: [p.name for p in art.state_pools]}
    return {k: v for k, v in classes.items() if v}


def page_bytes(art, pool_class: str) -> int:
    """Bytes of one page (row) of every pool of the class together (on every device)."""
    specs = pool_specs(art)
    return sum(int(np.prod(specs[name][0][1:])) * specs[name][1].itemsize
               for name in pool_classes(art).get(pool_class, ()))


class PageTransfer:
    """Reads and writes pages of a runtime's pools (runtime.Runtime: `pools` by name, the
    artifact's pool lists, its PJRT device and compile cache). Each program is a JAX function
    lowered to StableHLO for its pool class and bucket and compiled like an entry, through the
    on-disk compile cache. Donated writes are checked like entries: the pools stay at their
    addresses (counted in `in_place` / `copied`)."""

    def __init__(self, runtime):
        self.rt = runtime
        art = runtime.artifact
        self.classes = pool_classes(art)
        self._programs: dict[tuple[str, str, int], object] = {}
        self._compiling = threading.Lock()  # `warm` may run on a thread of its own
        self.compile_stats = CompileStats()
        self.in_place = self.copied = 0
        self.seconds = {"read": 0.0, "write": 0.0}

    def page_bytes(self, pool_class: str) -> int:
        """Bytes of one page (row) of every pool of the class together (on every device)."""
        return page_bytes(self.rt.artifact, pool_class)

    def warm(self, counts: dict[str, tuple[int, ...]]) -> None:
        """Compile (or load from the compile cache) the programs for these bucket sizes per
        pool class (at load, or on a thread then; `transfer_buckets`), so a swap does not wait
        for a compile; one that comes first compiles its own program."""
        specs = pool_specs(self.rt.artifact)
        for pool_class, names in self.classes.items():
            rows = specs[names[0]][0][0]  # from the manifest: `tlaloc compile` has no pools
            for n in counts.get(pool_class, ()):
                if n > rows:
                    break
                self._program("read", pool_class, n)
                self._program("write", pool_class, n)

    def _program(self, kind: str, pool_class: str, n: int):
        """The executable reading (gather) or writing (donated scatter) n rows of every pool
        of the class, made on first use."""
        key = (kind, pool_class, n)
        exe = self._programs.get(key)
        if exe is not None:
            return exe
        with self._compiling:
            exe = self._programs.get(key)
            if exe is not None:  # compiled by the other thread meanwhile
                return exe
            # From the manifest, not the pools: another thread may be donating them.
            specs_by_name = pool_specs(self.rt.artifact)
            pools = [specs_by_name[name] for name in self.classes[pool_class]]
            if self.rt.device.size == 1 and not any("float8" in str(d) for _, d in pools):
                text = transfer_text(kind, pools, n)  # no JAX needed (the C API runtime)
                exe = compile_cached(self.rt.device, text, f"page {kind} {pool_class} x{n}",
                                     self.rt.cache_dir, self.rt.use_cache, self.compile_stats)
                self._programs[key] = exe
                return exe
            from .capi import CapiMesh, PluginError

            if isinstance(self.rt.device, CapiMesh):
                raise PluginError("the host tier on several devices with the C API runtime: "
                                  "not yet (its page copies are lowered by JAX)")
            import jax

            specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in pools]
            idx = jax.ShapeDtypeStruct((n,), np.int32)
            split, whole = self._shardings(pool_class)
            with x64_mode(any(np.dtype(dtype).itemsize == 8 for _, dtype in pools)):
                if kind == "read":
                    jitted = (jax.jit(_gather) if split is None else
                              jax.jit(_gather, in_shardings=(split, whole),
                                      out_shardings=tuple(split)))
                    args = (specs, idx)
                else:
                    rows = [jax.ShapeDtypeStruct((n, *shape[1:]), dtype) for shape, dtype in pools]
                    jitted = (jax.jit(_scatter, donate_argnums=0) if split is None else
                              jax.jit(_scatter, donate_argnums=0,
                                      in_shardings=(split, whole, split),
                                      out_shardings=tuple(split)))
                    args = (specs, idx, rows)
                lowered = (jitted.lower(*args) if split is None else jitted.trace(*args).lower(
                    lowering_platforms=(self.rt.device.platform,)))
            exe = compile_cached(self.rt.device, lowered.as_text(),
                                 f"page {kind} {pool_class} x{n}", self.rt.cache_dir,
                                 self.rt.use_cache, self.compile_stats)
            self._programs[key] = exe
        return exe

    def _shardings(self, pool_class: str) -> tuple[list | None, object]:
        """A tensor-parallel artifact's pools of the class as the programs see them, each
        split along its axis over the devices' mesh, and the replicated page index ((None,
        None) on one device). A write's rows are split as their pools are."""
        tp = self.rt.artifact.tensor_parallel
        if tp is None:
            return None, None
        art = self.rt.artifact
        specs = pool_specs(art)
        return ([mesh_sharding(tp.devices, len(specs[name][0]), art.pool_axis(name))
                 for name in self.classes[pool_class]], mesh_sharding(tp.devices, 1))

    def read(self, pool_class: str, pages: list[int]) -> HostPages:
        """Host copies of these pages (rows) of every pool of the class, in the order given."""
        names = self.classes[pool_class]
        n = len(pages)
        idx = np.zeros(bucket(n), np.int32)  # padding reads page 0 (never handed out)
        idx[:n] = pages
        exe = self._program("read", pool_class, len(idx))
        t0 = time.perf_counter()
        device = self.rt.device
        outs = device.execute(exe, [*(self.rt.pools[name] for name in names), device.put(idx)])
        arrays = {name: device.host(out, self.rt.artifact.pool_axis(name))[:n]
                  for name, out in zip(names, outs)}
        self.seconds["read"] += time.perf_counter() - t0
        return HostPages(pool_class, arrays)

    def write(self, host: HostPages, pages: list[int]) -> None:
        """Write `host`'s rows into these pages (rows) of every pool of its class, in order;
        the pools are donated and replaced by the results."""
        assert len(pages) == host.count, f"{host.count} rows for {len(pages)} pages"
        names = self.classes[host.pool_class]
        rows = pool_specs(self.rt.artifact)[names[0]][0][0]
        n = bucket(len(pages))
        idx = np.full(n, rows, np.int32)  # past the pool: dropped
        idx[:len(pages)] = pages
        padded = []
        for name in names:
            a = host.arrays[name]
            if len(a) < n:
                a = np.concatenate([a, np.zeros((n - len(a), *a.shape[1:]), a.dtype)])
            padded.append(a)
        exe = self._program("write", host.pool_class, n)
        device = self.rt.device
        before = [device.addresses(self.rt.pools[name]) for name in names]
        t0 = time.perf_counter()
        axis = self.rt.artifact.pool_axis
        args = [*(self.rt.pools[name] for name in names), device.put(idx),
                *(device.put_split(a, axis(name)) for name, a in zip(names, padded))]
        outs = device.execute(exe, args)
        del args
        for name, out in zip(names, outs):
            self.rt.pools[name] = out
        self.seconds["write"] += time.perf_counter() - t0
        moved = sum(b != device.addresses(self.rt.pools[name])
                    for b, name in zip(before, names))
        if moved:
            self.copied += 1
            log.warning("a page write copied %d of %d %s pools instead of updating them in "
                        "place", moved, len(names), host.pool_class)
        else:
            self.in_place += 1


def transfer_text(kind: str, pools: list[tuple[tuple[int, ...], np.dtype]], n: int) -> str:
    """StableHLO of a one-device page transfer: `read` gathers rows idx [n] (i32) of every
    pool; `write` scatters rows [n, ...] into them at idx, each pool donated (its output
    aliases it) and an index past a pool's end dropped (StableHLO's scatter skips an update
    window out of bounds; the padding of a bucket points there)."""
    def ty(shape, dtype):
        return f"tensor<{'x'.join(map(str, shape))}x{dtype_name(dtype)}>"

    kinds = [(ty(shape, dt), ty((n, *shape[1:]), dt), shape, dtype_name(dt))
             for shape, dt in pools]

    def window(shape):  # the dimensions a row spans, past the row index
        return ", ".join(str(d) for d in range(1, len(shape)))

    body = [f"    %idx = stablehlo.reshape %arg_idx : (tensor<{n}xi32>) -> tensor<{n}x1xi32>"]
    if kind == "read":
        params = [f"%p{i}: {pool}" for i, (pool, _, _, _) in enumerate(kinds)]
        params.append(f"%arg_idx: tensor<{n}xi32>")
        for i, (pool, rows, shape, _) in enumerate(kinds):
            sizes = ", ".join(str(d) for d in (1, *shape[1:]))
            body.append(
                f'    %o{i} = "stablehlo.gather"(%p{i}, %idx) <{{dimension_numbers = '
                f"#stablehlo.gather<offset_dims = [{window(shape)}], collapsed_slice_dims = [0], "
                f"start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, "
                f"slice_sizes = array<i64: {sizes}>}}> : ({pool}, tensor<{n}x1xi32>) -> {rows}")
        results = [rows for _, rows, _, _ in kinds]
    else:
        params = [f"%p{i}: {pool} {{tf.aliasing_output = {i} : i32}}"
                  for i, (pool, _, _, _) in enumerate(kinds)]
        params.append(f"%arg_idx: tensor<{n}xi32>")
        params += [f"%r{i}: {rows}" for i, (_, rows, _, _) in enumerate(kinds)]
        for i, (pool, rows, shape, element) in enumerate(kinds):
            body += [
                f'    %o{i} = "stablehlo.scatter"(%p{i}, %idx, %r{i}) <{{indices_are_sorted = '
                f"false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = "
                f"[{window(shape)}], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], "
                f"index_vector_dim = 1>, unique_indices = false}}> ({{",
                f"    ^bb0(%old{i}: tensor<{element}>, %new{i}: tensor<{element}>):",
                f"      stablehlo.return %new{i} : tensor<{element}>",
                f"    }}) : ({pool}, tensor<{n}x1xi32>, {rows}) -> {pool}"]
        results = [pool for pool, _, _, _ in kinds]
    body.append(f"    return {', '.join(f'%o{i}' for i in range(len(kinds)))} : "
                f"{', '.join(results)}")
    return (f"module @page_{kind} {{\n  func.func public @main({', '.join(params)}) -> "
            f"({', '.join(results)}) {{\n" + "\n".join(body) + "\n  }\n}\n")


def _bytes(x):
    """An fp8 array as its bytes, any other as itself. XLA's CPU backend gathers and scatters f8
    in f16, converting the whole pool there and back on every call; on the bytes it moves
    integers. The pools of a current artifact are held as bytes already (manifest.BITS); an
    older artifact's programs take them as e4m3fn."""
    from jax import lax

    if "float8" in str(x.dtype):
        return lax.bitcast_convert_type(x, np.uint8)
    return x


def _as(x, dtype):
    """`_bytes` undone."""
    from jax import lax

    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _gather(pools, idx):
    return tuple(_as(_bytes(p)[idx], p.dtype) for p in pools)


def _scatter(pools, idx, rows):
    # Out-of-range rows (the padding) are dropped.
    return tuple(_as(_bytes(p).at[idx].set(_bytes(r), mode="drop"), p.dtype)
                 for p, r in zip(pools, rows))

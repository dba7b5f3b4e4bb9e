"""The small programs the runtime writes as StableHLO text on one device, not lowered by JAX
(so the C API runtime has them): the host tier's page read (gather) and write (donated
scatter, padding rows past the end dropped) and the adapter slot write equal the JAX
functions they replace, bit for bit, for f32, 16- and 8-bit pools. Control: rows written one
place off differ."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from triton_tlaloc.runtime.adapter_pools import _write_slot, slot_write_text
from triton_tlaloc.runtime.kv_transfer import _gather, _scatter, transfer_text
from triton_tlaloc.runtime.pjrt import PjrtDevice

POOLS = [((10, 2, 4, 3), np.dtype(np.float32)), ((10, 5), np.dtype(np.uint16)),
         ((10, 3), np.dtype(np.uint8))]


def run(device, text, args):
    outs = device.execute(device.compile(text), [device.put(a) for a in args])
    return [np.asarray(o) for o in outs]


def test_page_reads_and_writes_equal_the_jax_functions():
    device, rng = PjrtDevice(), np.random.default_rng(0)
    pools = [(rng.standard_normal(shape) * 100).astype(dtype) for shape, dtype in POOLS]
    idx = np.array([3, 7, 1, 12], np.int32)  # 12: a bucket's padding, past the end
    rows = [(rng.standard_normal((4, *shape[1:])) * 100).astype(dtype) for shape, dtype in POOLS]
    got = run(device, transfer_text("read", POOLS, 4), [*pools, idx])
    want = _gather([jnp.asarray(p) for p in pools], jnp.asarray(idx))
    assert all(np.array_equal(g[:3], np.asarray(w)[:3]) for g, w in zip(got, want))
    got = run(device, transfer_text("write", POOLS, 4), [*pools, idx, *rows])
    want = _scatter([jnp.asarray(p) for p in pools], jnp.asarray(idx),
                    [jnp.asarray(r) for r in rows])
    assert all(np.array_equal(g, np.asarray(w)) for g, w in zip(got, want))
    off = _scatter([jnp.asarray(p) for p in pools], jnp.asarray(idx + 1),
                   [jnp.asarray(r) for r in rows])
    assert not np.array_equal(got[0], np.asarray(off[0]))  # the control


def test_the_adapter_slot_write_equals_the_jax_function():
    device, rng = PjrtDevice(), np.random.default_rng(1)
    shapes = [(2, 3, 4, 5), (2, 3, 6, 4)]
    pools = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    rows = [rng.standard_normal((s[0], *s[2:])).astype(np.float32) for s in shapes]
    got = run(device, slot_write_text(shapes), [*pools, np.int32(2), *rows])
    want = jax.jit(_write_slot)([jnp.asarray(p) for p in pools], 2,
                                [jnp.asarray(r) for r in rows])
    assert all(np.array_equal(g, np.asarray(w)) for g, w in zip(got, want))
    assert not np.array_equal(got[0], pools[0])

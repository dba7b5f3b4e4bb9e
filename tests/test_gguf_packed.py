"""GGUF's quantized types kept packed (export/gguf_packed.py): for every type kept, the values
the packed layout reads back, in numpy and inside a jitted JAX graph, are gguf-py's
dequantized values bit for bit (f32 compared as integers). Tensors of the simple types are
quantized by gguf-py from random values; the K types' blocks are random bytes with finite f16
scales. Control: each group read with its neighbour's scale is caught."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from triton_tlaloc.export.gguf_packed import BLOCKS, PackError, dequantize, pack  # noqa: E402

ROWS, COLS = 8, 512  # rows: whole bands of every type (at most 8)


def raw_tensor(qtype: str, rng, rows: int = ROWS) -> np.ndarray:
    """[rows, bytes per row] of a tensor of this type, as a GGUF file holds it."""
    kind = gguf.GGMLQuantizationType[qtype]
    try:
        values = (rng.standard_normal((rows, COLS)) * 0.05).astype(np.float32)
        values[0, :32] = 0.0  # a block of zeros (a zero scale)
        return gguf.quants.quantize(values, kind)
    except NotImplementedError:
        per_block, size = BLOCKS[qtype]
        blocks = rng.integers(0, 256, (rows * COLS // per_block, size), dtype=np.uint8)
        for at in F16_FIELDS[qtype]:  # finite scales, as a quantizer writes
            blocks[:, at:at + 2] = (rng.standard_normal((blocks.shape[0], 1)) * 0.01).astype(
                np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)


# Where each K type's f16 fields lie in its block
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", list(BLOCKS))
def test_the_packed_values_are_gguf_pys_bit_for_bit(qtype):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(list(BLOCKS).index(qtype))
    raw = raw_tensor(qtype, rng)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert want.shape == (ROWS, COLS)
    packed = pack(qtype, raw, (ROWS, COLS))
    assert same_bits(dequantize(packed), want)
    in_graph = jax.jit(lambda: dequantize(packed, jnp))()
    assert same_bits(np.asarray(in_graph), want)
    bits_per_element = 8 * packed.nbytes / (ROWS * COLS)
    assert bits_per_element <= 8 * raw.nbytes / (ROWS * COLS) * 2.0  # f32 scales: at most 2x
    packed.scale = np.roll(packed.scale, 1, axis=1)  # the control: a neighbour's scale
    assert not same_bits(dequantize(packed), want)


@pytest.mark.parametrize("qtype", list(BLOCKS))
def test_the_programs_widening_reads_gguf_pys_values(qtype):
    """What an exported program computes from the stored arrays (export/packed_linear.py, the
    codes in row bands, each band read with a shift and a mask): the whole weight, and rows
    gathered as the embedding gathers them, equal gguf-py's values bit for bit; its products
    (a matrix-vector product per band, or one over the widened weight) equal the values'."""
    import jax
    import jax.numpy as jnp

    from triton_tlaloc.export.gguf_packed import LAYOUTS
    from triton_tlaloc.export.packed_linear import gathered_rows, packed_product, weight_values

    rng = np.random.default_rng(10 + list(BLOCKS).index(qtype))
    raw = raw_tensor(qtype, rng)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    packed = pack(qtype, raw, (ROWS, COLS))
    arrays = packed.arrays()
    assert [(s, a.shape) for s, a in arrays.items()] == [
        (s, shape) for s, _, shape in LAYOUTS[qtype].parts(ROWS, COLS)]
    w = {"t" + sfx: jnp.asarray(a) for sfx, a in arrays.items()}
    whole = jax.jit(lambda w: weight_values(qtype, w, "t"))(w)
    assert same_bits(np.asarray(whole), want)
    ids = jnp.asarray([[5, 0, 7], [3, 3, 1]], jnp.int32)
    rows = jax.jit(lambda w, i: gathered_rows(qtype, w, "t", i))(w, ids)
    assert same_bits(np.asarray(rows), want[np.asarray(ids)])
    for n in (2, 9):  # products per row and band; one product over the widened weight
        x = rng.standard_normal((n, COLS)).astype(np.float32)
        got = jax.jit(lambda w, x: packed_product(x, qtype, w, "t", 8))(w, x)
        ref = x.astype(np.float64) @ want.T.astype(np.float64)
        assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))  # f32 sums' rounding
    w["t.scale"] = jnp.roll(w["t.scale"], 1, axis=1)  # the control: a neighbour's scale
    assert not same_bits(np.asarray(weight_values(qtype, w, "t")), want)


# A type of each packed shape: 2 bands with an offset, 8 bands, 4 bands of group 16, 8-bit codes
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q6_K", "Q8_0"])
def test_a_weight_divided_over_devices_reads_its_values_on_each(qtype):
    """Tensor parallel on 2 devices, as the program's arrays hold the shards one device after
    another: a fused weight of two parts split along its rows, each device's piece of each part
    banded on its own, widens to the rows in the program's order (device 0's piece of each
    part, then device 1's); a table split the same way gathers its rows (equal values: the
    devices' rows are summed, so a -0.0 reads +0.0); a weight split along
    its inputs (banded whole) widens and multiplies to the whole weight's values. Control: the
    pieces banded at once are caught."""
    import jax
    import jax.numpy as jnp

    from triton_tlaloc.artifact.sharding import Segment, Split, single_split
    from triton_tlaloc.export.packed_linear import (PackedShards, gathered_rows, packed_product,
                                                    weight_values)

    rng = np.random.default_rng(20 + list(BLOCKS).index(qtype))
    rows = 32
    raw = raw_tensor(qtype, rng, rows)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    packed = pack(qtype, raw, (rows, COLS))
    fused = Split(0, (Segment(16), Segment(16)))  # in rows; a plane's segments in its rows
    program_rows = np.concatenate([np.arange(0, 8), np.arange(16, 24), np.arange(8, 16),
                                   np.arange(24, 32)])

    def program_arrays(arrays, split_of):
        return {"t" + sfx: jnp.asarray(np.concatenate([split_of(a).shard(a, j, 2)
                                                       for j in range(2)]))
                for sfx, a in arrays.items()}

    def by_rows(a):
        fields = rows // a.shape[0]
        return Split(0, tuple(Segment(s.width // fields) for s in fused.segments))

    w = program_arrays(packed.arrays(fused.file_pieces(2)), by_rows)
    sh = PackedShards(2, fused.device_pieces(2))
    assert same_bits(np.asarray(jax.jit(lambda w: weight_values(qtype, w, "t", sh))(w)),
                     want[program_rows])
    x = rng.standard_normal((2, COLS)).astype(np.float32)
    got = jax.jit(lambda w, x: packed_product(x, qtype, w, "t", 8, sh))(w, x)
    ref = x.astype(np.float64) @ want[program_rows].T.astype(np.float64)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
    table = program_arrays(packed.arrays((16, 16)), lambda a: single_split(0, a.shape[0]))
    ids = jnp.asarray([[5, 17, 31], [16, 0, 15]], jnp.int32)
    got = jax.jit(lambda w, i: gathered_rows(qtype, w, "t", i, 2))(table, ids)
    # the devices' rows meet in a sum: equal values, a -0.0 read as +0.0
    assert np.array_equal(np.asarray(got), want[np.asarray(ids)])
    inputs = {"t" + sfx: jnp.asarray(a) for sfx, a in packed.arrays().items()}
    sh_in = PackedShards(2, by_inputs=True)
    assert same_bits(np.asarray(jax.jit(lambda w: weight_values(qtype, w, "t", sh_in))(inputs)),
                     want)
    got = jax.jit(lambda w, x: packed_product(x, qtype, w, "t", 8, sh_in))(inputs, x)
    ref = x.astype(np.float64) @ want.T.astype(np.float64)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
    at_once = program_arrays(packed.arrays(), by_rows)  # the control
    if packed.layout.bits != 8:  # (8-bit codes have no bands)
        assert not same_bits(np.asarray(weight_values(qtype, at_once, "t", sh)),
                             want[program_rows])


def test_fused_rows_and_moved_rows_keep_their_values():
    from triton_tlaloc.export.gguf_packed import stack_rows

    rng = np.random.default_rng(3)
    a, b = (pack("Q4_1", raw_tensor("Q4_1", rng), (ROWS, COLS)) for _ in range(2))
    both = stack_rows([a, b], "l0.gate_up")
    assert both.qtype == "Q4_1"  # one type: its own layout
    assert same_bits(dequantize(both), np.concatenate([dequantize(a), dequantize(b)]))
    order = np.array([2, 0, 1, 5, 4, 3, 7, 6])
    assert same_bits(dequantize(a.take_rows(order)), dequantize(a)[order])


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q4_1", "Q5_0"), ("Q4_0", "Q5_1", "Q6_K"),
                                   ("Q5_K", "Q4_K", "Q5_K"), ("Q5_0", "Q8_0", "Q5_0")])
def test_tensors_of_different_types_share_one_layout_that_keeps_their_values(types):
    """A Q4_K_M file fuses a Q6_K attn_v with Q4_K attn_q and attn_k, and its ffn_down changes
    type from layer to layer: the weights share the layout mixed_type gives (the largest zero,
    the bits that hold every code from there, the smallest group, an offset), in which each
    reads back gguf-py's values (as values: a -0.0 reads +0.0 where a zero offset is added),
    in numpy and in the program's widening."""
    import jax
    import jax.numpy as jnp

    from triton_tlaloc.export.gguf_packed import layout_of, mixed_type, stack_rows
    from triton_tlaloc.export.packed_linear import weight_values

    rng = np.random.default_rng(len(types))
    raws = [raw_tensor(t, rng) for t in types]
    want = np.concatenate([gguf.quants.dequantize(r, gguf.GGMLQuantizationType[t])
                           for t, r in zip(types, raws)])
    joined = stack_rows([pack(t, r, (ROWS, COLS)) for t, r in zip(types, raws)], "l0.qkv")
    assert joined.qtype == mixed_type(list(types)) and layout_of(joined.qtype)
    assert np.array_equal(dequantize(joined), want)
    w = {"t" + sfx: jnp.asarray(a) for sfx, a in joined.arrays().items()}
    assert np.array_equal(np.asarray(jax.jit(lambda w: weight_values(joined.qtype, w, "t"))(w)),
                          want)
    joined.codes[1, 5] ^= 1  # the control: one code's lowest bit (row 0 starts with zeros)
    assert not np.array_equal(dequantize(joined), want)


def test_a_type_not_kept_packed_is_refused_by_name():
    with pytest.raises(PackError, match="GGUF type Q2_K is not kept packed"):
        pack("Q2_K", np.zeros((1, 84), np.uint8), (1, 256))
    with pytest.raises(PackError, match="not whole blocks of 32"):
        pack("Q4_0", np.zeros((1, 18), np.uint8), (1, 40))

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

ROWS, COLS = 6, 512


def raw_tensor(qtype: str, rng) -> np.ndarray:
    """[ROWS, bytes per row] of a tensor of this type, as a GGUF file holds it."""
    kind = gguf.GGMLQuantizationType[qtype]
    try:
        values = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
        values[0, :32] = 0.0  # a block of zeros (a zero scale)
        return gguf.quants.quantize(values, kind)
    except NotImplementedError:
        per_block, size = BLOCKS[qtype]
        blocks = rng.integers(0, 256, (ROWS * COLS // per_block, size), dtype=np.uint8)
        for at in F16_FIELDS[qtype]:  # finite scales, as a quantizer writes
            blocks[:, at:at + 2] = (rng.standard_normal((blocks.shape[0], 1)) * 0.01).astype(
                np.float16).view(np.uint8)
        return blocks.reshape(ROWS, -1)


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


def test_a_type_not_kept_packed_is_refused_by_name():
    with pytest.raises(PackError, match="GGUF type Q2_K is not kept packed"):
        pack("Q2_K", np.zeros((1, 84), np.uint8), (1, 256))
    with pytest.raises(PackError, match="not whole blocks of 32"):
        pack("Q4_0", np.zeros((1, 18), np.uint8), (1, 40))

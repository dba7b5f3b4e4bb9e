"""PAGED_ATTENTION, in two forms that give the same result (docs/design.md#paged-attention).

Both take the queries of a call, the pools, each row's block table, each token's position and
each row's length; a token sees the keys at positions <= its own and < its row's length. Scores,
softmax and P.V are f32. A token that sees no key (a row of length 0, a padding row) comes out 0.

Masks select (jnp.where), on the scores and on the values, never multiply: a page given to a
new sequence still holds its earlier holder's keys and values past the new row's length (a
ring, in the slots the row has not written yet), and those may be NaN or infinite (a sequence
whose weights or adapter gave NaN). A zero weight times NaN is NaN, so a value a row does not
hold is set to 0 before P.V, and a score it may not see to the lowest float before the
softmax: no page's old contents reach another sequence's result.

- `one_pass`: gather every page the block table names once per row, score all of them, mask,
  normalize. Used by entries whose context is one key block.
- `blockwise`: a while loop over key blocks of `key_block` positions, from block 0 to the block
  holding the call's last live position (a dynamic trip count: a call early in a large bucket
  gathers and scores only the blocks its rows have, decode and prefill alike). Each iteration
  gathers one block's pages, scores them, and folds them into a running max, sum and P.V (the
  online softmax), so no score tensor as wide as the context is ever written.
- `by_length`: `blockwise` with its key block chosen, in the program, by the positions the
  call holds (small blocks for a short sequence, large ones for a long one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


# An fp8 (e4m3fn) pool is held as its bytes, uint8: the programs take and return it so
# (manifest.BITS). XLA's CPU backend has no f8 arithmetic: its float normalization runs a gather
# or scatter of an f8 array in f16, which converts the WHOLE pool f8 -> f16 at the start of every
# call and back at its end (SmolLM2, fp8 KV at context 1,024: 1.7 s a token against 29 ms with
# f32 KV). On the bytes the scatters and gathers move integers: `take_pages` bitcasts only the
# pages it gathers back to e4m3fn (attention widens them to f32) and `to_bits` is a write's codes
# as bytes. A program that took the pool as e4m3fn and bitcast it to bytes inside would copy the
# whole pool twice a call (XLA's CPU backend runs a whole-array bitcast as a copy): a SmolLM2
# step over 300 pages took 37 ms against 20 (docs/performance.md#tensors-taken-as-their-bits).
FP8, FP8_BITS = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)


def to_bits(codes):
    """e4m3fn codes as the bytes an fp8 pool is held as."""
    from jax import lax

    return lax.bitcast_convert_type(codes, FP8_BITS)


# What a program reads a tensor held as its bits (manifest.BITS) as: bf16 from uint16, e4m3fn
# from uint8 (no other weight or pool is held as unsigned integers).
FROM_BITS = {np.dtype(np.uint16): np.dtype(ml_dtypes.bfloat16), FP8_BITS: FP8}


def from_bits(x):
    """Values held as their bits in their own type again (an fp8 pool's pages, a layer of a
    stacked bf16 or f8 weight); anything else as it is."""
    from jax import lax

    dtype = FROM_BITS.get(np.dtype(x.dtype))
    return x if dtype is None else lax.bitcast_convert_type(x, dtype)


@dataclass(frozen=True)
class LayerPool:
    """One layer of a pool stacked over the layers, [pages, layers, block, kh, d], inside the
    layer loop: it reads as that layer's [pages, block, kh, d] pool, and a gather of its pages
    reads that layer's slab of each page only."""

    stacked: Any
    layer: Any  # the loop's layer index, a traced int32

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.stacked.shape
        return (s[0], *s[2:])

    @property
    def dtype(self):
        return self.stacked.dtype


def take_pages(pool, tables):
    """pool[tables]: [*tables.shape, block, kh, d], of a layer's pool or of a LayerPool; an
    fp8 pool's pages gathered as bytes and read as e4m3fn codes (`from_bits`)."""
    import jax.numpy as jnp

    if isinstance(pool, LayerPool):
        return from_bits(pool.stacked[tables, pool.layer])
    return from_bits(jnp.take(pool, tables, axis=0))


def _gather(k_pool, v_pool, tables):
    """The pages a table names, per row: [b, pages x block, kh, d] keys and values."""
    b, n = tables.shape
    _, block_size, kh, d = k_pool.shape
    return tuple(take_pages(pool, tables).reshape(b, n * block_size, kh, d)
                 for pool in (k_pool, v_pool))


def _masked_scores(q, keys, key_pos, positions, seq_lens, scale, window):
    """q [b,t,kh,g,d], keys [b,c,kh,d], key_pos [c] -> (scores [b,kh,g,t,c], mask [b,1,1,t,c],
    held [b,c]: the key positions each row holds, below its length). A token at position p
    sees the keys at p - window + 1 .. p (all up to p without a window)."""
    import jax.numpy as jnp
    from jax import lax

    s = jnp.einsum("btkgd,bckd->bkgtc", q, keys.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    kp, pos = key_pos[None, None, :], positions[:, :, None]
    mask = (kp <= pos) & (kp < seq_lens[:, None, None])
    if window is not None:
        mask = mask & (kp > pos - window)
    return s, mask[:, None, None, :, :], key_pos[None, :] < seq_lens[:, None]


def held_values(values, held):
    """values [b,c,kh,d] as f32, 0 at the key positions a row does not hold (held [b,c]
    False): selected, since a zero weight times a stale NaN there would be NaN."""
    import jax.numpy as jnp

    return jnp.where(held[:, :, None, None], values.astype(jnp.float32), np.float32(0))


def one_pass(q, k_pool, v_pool, block_tables, positions, seq_lens, window=None, scale=None):
    """q [b,t,kh,g,d] f32; pools [pages, block, kh, d]; block_tables [b, m]; positions [b, t];
    seq_lens [b]; window: a sliding window in positions or None; scale: the score scale (default
    head_size ** -0.5). Returns [b,t,kh,g,d] f32."""
    import jax.numpy as jnp

    b, m = block_tables.shape
    _, block_size, kh, d = k_pool.shape
    context = m * block_size
    keys, values = _gather(k_pool, v_pool, block_tables)
    scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    s, mask, held = _masked_scores(q, keys, jnp.arange(context, dtype=jnp.int32), positions,
                                   seq_lens, scale, window)
    return _softmax_pv(s, mask, held_values(values, held))


def _softmax_pv(s, mask, values):
    """Softmax over the live keys and P.V: [b,kh,g,t,c] scores and mask, [b,c,kh,d] values
    (f32, 0 where the row holds no key: `held_values`) -> [b,t,kh,g,d]. Masked keys add
    exactly nothing, whatever their page holds; a token with no live key comes out 0."""
    import jax.numpy as jnp
    from jax import lax

    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), np.float32(0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bkgtc,bckd->btkgd", p, values, precision=lax.Precision.HIGHEST)


def blockwise(q, k_pool, v_pool, block_tables, positions, seq_lens, key_block: int, window=None,
              scale=None):
    """The same attention as `one_pass`, one key block of `key_block` positions at a time.
    Positions of padding tokens must not be below their row's first token (engine/steps.py gives
    them the first token's position): with a window, the loop starts at the first block the call's
    earliest token can see."""
    import jax.numpy as jnp
    from jax import lax

    _, block_size, kh, d = k_pool.shape
    assert key_block % block_size == 0, "a key block is whole pages"
    pages_per_block = key_block // block_size
    short = -block_tables.shape[1] % pages_per_block
    if short:
        # A context that is not whole key blocks: the last block's missing pages name page 0;
        # their positions lie past the context, past every row's length, so they are masked.
        block_tables = jnp.pad(block_tables, ((0, 0), (0, short)))
    b, m = block_tables.shape
    t, g = q.shape[1], q.shape[3]
    scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    neg = jnp.finfo(jnp.float32).min
    # From the first block any row can see to the block holding the call's last live position;
    # a call with no live position runs no iteration and comes out 0.
    live = seq_lens > 0
    last = jnp.max(jnp.where(live, seq_lens - 1, -1))
    n_blocks = jnp.where(last >= 0, last // key_block + 1, 0)
    first_block = 0
    if window is not None:
        earliest = jnp.min(jnp.where(live[:, None], positions, jnp.iinfo(jnp.int32).max))
        first_block = jnp.where(last >= 0, jnp.maximum(earliest - window + 1, 0) // key_block, 0)

    def body(j, carry):
        run_max, run_sum, acc = carry
        pages = lax.dynamic_slice_in_dim(block_tables, j * pages_per_block, pages_per_block,
                                         axis=1)
        keys, values = _gather(k_pool, v_pool, pages)
        key_pos = j * key_block + jnp.arange(key_block, dtype=jnp.int32)
        s, mask, held = _masked_scores(q, keys, key_pos, positions, seq_lens, scale, window)
        s = jnp.where(mask, s, neg)
        new_max = jnp.maximum(run_max, jnp.max(s, axis=-1))
        correction = jnp.exp(run_max - new_max)
        # masked keys add nothing, even at neg, and whatever their page holds
        p = jnp.where(mask, jnp.exp(s - new_max[..., None]), np.float32(0))
        run_sum = run_sum * correction + jnp.sum(p, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "bkgtc,bckd->bkgtd", p, held_values(values, held), precision=lax.Precision.HIGHEST)
        return new_max, run_sum, acc

    init = (jnp.full((b, kh, g, t), neg, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
            jnp.zeros((b, kh, g, t, d), jnp.float32))
    _, run_sum, acc = lax.fori_loop(first_block, n_blocks, body, init)
    out = acc / jnp.where(run_sum > 0, run_sum, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4))  # [b, t, kh, g, d]


def usable_key_blocks(key_blocks: tuple[int, ...], context: int) -> tuple[int, ...]:
    """The key blocks a context can use: the smallest, and each larger one the context holds
    more than two of (a call holds more than two only then)."""
    return (key_blocks[0], *(kb for kb in key_blocks[1:] if 2 * kb < context))


def by_length(q, k_pool, v_pool, block_tables, positions, seq_lens, key_blocks, window=None,
              scale=None):
    """`blockwise` with the key block chosen by the positions the call holds: the largest of
    `key_blocks` (ascending) that the call holds more than two of, else the smallest; a block
    the context cannot hold more than two of is left out of the program (usable_key_blocks).
    A short sequence reads little past its last position; a long one loops over few large
    blocks, since every iteration of every layer costs a loop step (on the CPU a 7,600-position
    SmolLM2 step took 52 ms in blocks of 256 and 43 ms in blocks of 1,024)."""
    import jax.numpy as jnp
    from jax import lax

    key_blocks = usable_key_blocks(key_blocks, block_tables.shape[1] * k_pool.shape[1])
    if len(key_blocks) == 1:
        return blockwise(q, k_pool, v_pool, block_tables, positions, seq_lens, key_blocks[0],
                         window, scale)
    held = jnp.max(seq_lens)
    choice = sum((held > 2 * kb).astype(jnp.int32) for kb in key_blocks[1:])
    return lax.switch(choice, [
        lambda kb=kb: blockwise(q, k_pool, v_pool, block_tables, positions, seq_lens, kb, window,
                                scale)
        for kb in key_blocks])


def ring(q, k_pool, v_pool, ring_tables, positions, seq_lens, window: int, period: int,
         scale=None):
    """A sliding layer over its ring (docs/design.md#the-windowed-pool): `ring_tables` [b, r]
    names each row's ring pages in ring order; ring slot s holds the latest position written
    with position == s (mod period), i.e. (L - 1) - ((L - 1 - s) mod period) for a row of
    length L. A token at position p sees the slots whose position lies in p - window + 1 .. p.
    Valid when every call wrote at most period - min(p0, window - 1) tokens (the runtime splits
    longer ones), so no key a token needs was overwritten by a later token of its own call."""
    import jax.numpy as jnp
    from jax import lax

    b, r = ring_tables.shape
    _, block_size, kh, d = k_pool.shape
    width = r * block_size
    keys, values = _gather(k_pool, v_pool, ring_tables)
    scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    s = jnp.einsum("btkgd,bckd->bkgtc", q, keys.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    last = (seq_lens - 1)[:, None]  # [b, 1]
    slot = jnp.arange(width, dtype=jnp.int32)[None, :]
    held = last - jnp.mod(last - slot, period)  # [b, width]: the position in each slot
    kp, pos = held[:, None, :], positions[:, :, None]
    mask = (kp >= 0) & (kp <= pos) & (kp > pos - window) & (seq_lens > 0)[:, None, None]
    # a slot the row has not written yet (its ring is not full) holds a page's old contents
    written = (held >= 0) & (seq_lens > 0)[:, None]
    return _softmax_pv(s, mask[:, None, None, :, :], held_values(values, written))

"""LoRA adapters inside an entry's graph: each row's update B[slot] (A[slot] x), added to an
adapted linear's product (triton_tlaloc/lora/layout.py has the pools' layout). Slot 0's A and
B are zeros, so a row with no adapter (and a padding row) adds zeros: rows of different
adapters, and none, run in one call; a call whose rows are all slot 0 skips the update.

Each row's A and B are gathered once for all its tokens, out of the whole pools by (layer,
slot), then small f32 products: A for every module the part fuses at once, B module by module
(a part's B holds each module's own rows and rank columns, no zero blocks). Measured on
SmolLM2 (docs/performance.md#lora-adapters): slicing each row's A and B where they lie, row by
row, was slower (1.16x the plain decode call against 1.12x)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def lora_update(x, a_pool, b_pool, layer, slots, pieces: tuple[int, ...], devices: int = 1):
    """x [b, t, in]; a_pool [layers, slots, rank x modules, in]; b_pool [layers, slots,
    out, rank]; `layer` (an int, or the layer loop's traced index); slots [b]; `pieces` each
    module's outputs on one of the `devices` its B splits over (lora.layout.graph_pieces):
    each row's update [b, t, out], device 0's columns of every module, then device 1's ...,
    as a tensor-parallel fused product holds them (layers.split_fused). Each row's A and B
    are gathered out of the whole pools by (layer, slot): only they are read (a layer's slice
    of every slot is never copied)."""
    width = devices * sum(pieces)

    def update():
        rank = b_pool.shape[-1]
        a = a_pool[layer, slots]  # [b, rank x modules, in]
        b = b_pool[layer, slots]  # [b, out, rank]
        h = jnp.einsum("bti,bwi->btw", x, a, precision=HIGHEST)
        if devices > 1:  # each device's rows, as the fused product beside it holds them
            b = b.reshape(b.shape[0], devices, sum(pieces), rank)
        parts, row = [], 0
        for j, n in enumerate(pieces):
            hj = h[..., j * rank:(j + 1) * rank]
            parts.append(jnp.einsum("btr,bdor->btdo", hj, b[:, :, row:row + n],
                                    precision=HIGHEST) if devices > 1 else
                         jnp.einsum("btr,bor->bto", hj, b[:, row:row + n], precision=HIGHEST))
            row += n
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        return out.reshape(*x.shape[:-1], width)

    return lax.cond(jnp.any(slots != 0), update,
                    lambda: jnp.zeros((*x.shape[:-1], width), x.dtype))


__all__ = ["lora_update"]

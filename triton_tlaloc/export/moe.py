"""A mixture of experts in place of a layer's MLP (qwen3_moe, mixtral), inside an entry's graph.

Routing is transformers': the router's logits in f32, their softmax, the top k (`lax.top_k`:
of equal probabilities the lower expert index first), renormalized to sum to 1 when the family
does. Each chosen expert is a gated MLP; the token's output is the routing-weighted sum of its
experts' outputs.

What it costs follows the rows of the call (docs/design.md#mixtures-of-experts):

- Up to `matvec_rows` rows (a decode call): for each row and each of its k experts, that
  expert's gate|up and down are indexed out of the stacked weights and multiplied as
  matrix-vector products: only the chosen experts' weights are read.
- More rows (a prompt): the (row, expert) pairs sorted by expert into blocks of
  EXPERT_BLOCK rows, each block one expert's, run in a loop: each expert's weights are read
  once per block of its rows, for the chosen experts' arithmetic rounded up to whole blocks.
  Where that would be more rows than every expert over every row (a short chunk), every
  expert runs over every row instead, weighted by routing weights that are zero off the
  chosen experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .config import Experts

HIGHEST = lax.Precision.HIGHEST


def route(moe: Experts, x, router):
    """x [n, hidden] f32: each row's routing weights and experts, [n, k] each, largest first."""
    logits = jnp.dot(x, router.T, precision=HIGHEST)
    top, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), moe.top_k)
    if moe.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts


def mixture(moe: Experts, x, router, gate_up, down, act, matvec_rows: int, devices: int = 1):
    """The experts' output for x [..., hidden] (the MLP's normed input): [..., hidden].
    `gate_up` [experts, 2 * inter, hidden], `down` [experts, hidden, inter], as stored (a bf16
    weight is widened inside its product, its input rounded to bf16 as layers.matmul rounds a
    linear's). `devices` > 1: the experts split over the devices, each holding E / devices
    (expert parallelism; _on_their_devices)."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, hidden)
    weights, chosen = route(moe, flat, router)  # the router reads the unrounded input
    inter = moe.intermediate_size
    precision = HIGHEST if gate_up.dtype == jnp.float32 else None
    if gate_up.dtype == jnp.bfloat16:
        flat = lax.reduce_precision(flat, exponent_bits=8, mantissa_bits=7)
    if devices > 1:
        return _on_their_devices(flat, weights, chosen, gate_up, down, act, inter, precision,
                                 devices, flat.shape[0] <= matvec_rows).reshape(*lead, hidden)
    if flat.shape[0] <= matvec_rows:
        rows = []
        for r in range(flat.shape[0]):
            out = None
            for j in range(moe.top_k):
                e = chosen[r, j]
                gu = jnp.dot(lax.dynamic_index_in_dim(gate_up, e, keepdims=False)
                             .astype(jnp.float32), flat[r], precision=precision)
                h = act(gu[:inter]) * gu[inter:]
                if down.dtype == jnp.bfloat16:
                    h = lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
                y = jnp.dot(lax.dynamic_index_in_dim(down, e, keepdims=False)
                            .astype(jnp.float32), h, precision=precision) * weights[r, j]
                out = y if out is None else out + y
            rows.append(out)
        return jnp.stack(rows).reshape(*lead, hidden)
    n, k, experts = flat.shape[0], moe.top_k, moe.num_experts
    blocks = -(-n * k // EXPERT_BLOCK) + experts  # every expert's rows in whole blocks, at most
    if blocks * EXPERT_BLOCK < experts * n:
        out = _grouped(flat, weights, chosen, gate_up, down, act, inter, precision, blocks)
    else:
        out = _every_expert(flat, weights, chosen, gate_up, down, act, inter, precision, experts)
    return out.reshape(*lead, hidden)


# A prompt's rows grouped by expert run in blocks of this many rows, each block one expert's
# (measured on this CPU, 1,024 rows x 16 experts: 32 rows a block 31.2 ms, 64 9.0, 128 11.0)
EXPERT_BLOCK = 64


def _expert_mlp(x, gate_up, down, act, inter, precision):
    """One expert's gated MLP over rows x [n, hidden]."""
    gu = jnp.dot(x, gate_up.astype(jnp.float32).T, precision=precision)
    h = act(gu[:, :inter]) * gu[:, inter:]
    if down.dtype == jnp.bfloat16:
        h = lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
    return jnp.dot(h, down.astype(jnp.float32).T, precision=precision)


def _grouped(flat, weights, chosen, gate_up, down, act, inter, precision, blocks: int):
    """Each (row, chosen expert) pair sorted by expert into blocks of EXPERT_BLOCK rows, every
    expert's pairs in whole blocks of their own; each block runs its expert's MLP (a loop over
    the blocks, the expert's weights indexed, not copied); each pair's output, times its
    routing weight, added into its row. Each expert's weights are read once per block of its
    rows, and the work is the chosen experts' (rounded up to whole blocks)."""
    n, hidden = flat.shape
    k, experts = chosen.shape[1], gate_up.shape[0]
    pair_expert = chosen.reshape(-1)
    order = jnp.argsort(pair_expert, stable=True)
    sorted_expert = pair_expert[order]
    counts = jnp.sum(jax.nn.one_hot(pair_expert, experts, dtype=jnp.int32), axis=0)
    expert_blocks = (counts + EXPERT_BLOCK - 1) // EXPERT_BLOCK
    first_block = jnp.cumsum(expert_blocks) - expert_blocks
    first_pair = jnp.cumsum(counts) - counts
    rank = jnp.arange(n * k, dtype=jnp.int32) - first_pair[sorted_expert]
    dest = first_block[sorted_expert] * EXPERT_BLOCK + rank  # the pair's row in the blocks
    padded = jnp.zeros((blocks * EXPERT_BLOCK, hidden), flat.dtype).at[dest].set(
        flat[order // k])
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(expert_blocks),
                                                jnp.arange(blocks), side="right"), experts - 1)

    def block(args):
        x, e = args
        return _expert_mlp(x, lax.dynamic_index_in_dim(gate_up, e, keepdims=False),
                           lax.dynamic_index_in_dim(down, e, keepdims=False), act, inter,
                           precision)
    ys = lax.map(block, (padded.reshape(blocks, EXPERT_BLOCK, hidden), block_expert))
    pair_out = ys.reshape(-1, hidden)[dest] * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(flat).at[order // k].add(pair_out)


def _on_their_devices(flat, weights, chosen, gate_up, down, act, inter, precision,
                      devices: int, per_row: bool):
    """Expert parallelism: the stacked experts split over the devices, device d holding
    experts d * E / devices onwards, and every device computing only with the experts it
    holds; the devices' partial outputs meet in one all-reduce (the sum over the device axis).
    A decode call (`per_row`): the stacks viewed as [devices, E / devices, ...], each device
    indexing each row's chosen experts among its own (one it does not hold reads its first
    expert and counts zero). A prompt: every expert over every row, each device its own
    experts (the partitioner keeps the expert axis where it lies)."""
    if not per_row:
        return _every_expert(flat, weights, chosen, gate_up, down, act, inter, precision,
                             gate_up.shape[0])
    local_experts = gate_up.shape[0] // devices
    gu = gate_up.reshape(devices, local_experts, *gate_up.shape[1:])
    dn = down.reshape(devices, local_experts, *down.shape[1:])
    first = jnp.arange(devices, dtype=jnp.int32) * local_experts  # each device's first expert
    rows = []
    for r in range(flat.shape[0]):
        out = None
        for j in range(chosen.shape[1]):
            local = chosen[r, j] - first  # [devices]
            held = (local >= 0) & (local < local_experts)
            at = jnp.clip(local, 0, local_experts - 1)[:, None, None, None]
            g = jnp.take_along_axis(gu, at, axis=1)[:, 0].astype(jnp.float32)
            z = jnp.einsum("doh,h->do", g, flat[r], precision=precision)
            h = act(z[:, :inter]) * z[:, inter:]
            if down.dtype == jnp.bfloat16:
                h = lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
            d = jnp.take_along_axis(dn, at, axis=1)[:, 0].astype(jnp.float32)
            y = jnp.einsum("dhi,di->dh", d, h, precision=precision) * jnp.where(
                held, weights[r, j], 0.0)[:, None]
            out = y if out is None else out + y
        rows.append(out)
    return jnp.sum(jnp.stack(rows, axis=1), axis=0)


def _every_expert(flat, weights, chosen, gate_up, down, act, inter, precision, experts: int):
    """Every expert over every row, weighted by a dense [rows, experts] matrix of routing
    weights (zero off the chosen experts): fewer rows than the grouped blocks would hold."""
    dense = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32)
                    * weights[..., None], axis=1)  # [n, experts]
    gu = jnp.einsum("nh,eoh->eno", flat, gate_up.astype(jnp.float32), precision=precision)
    h = act(gu[..., :inter]) * gu[..., inter:]
    if down.dtype == jnp.bfloat16:
        h = lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
    y = jnp.einsum("eni,ehi->enh", h, down.astype(jnp.float32), precision=precision)
    return jnp.einsum("enh,ne->nh", y, dense, precision=HIGHEST)


__all__ = ["route", "mixture"]

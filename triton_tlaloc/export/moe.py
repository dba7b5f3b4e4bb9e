"""A mixture of experts in place of a layer's MLP (qwen3_moe, mixtral, qwen3_5_moe), inside an
entry's graph.

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
- On several devices (expert parallelism) each device computes with the experts it holds and
  the partial outputs meet in one all-reduce (_on_their_devices).

Each call also counts the (token, expert) pairs each layer routed (the entry's EXPERT_LOAD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Stacks:
    """A sparse layer's stacked experts as the entry holds them: gate|up [E, 2 * inter,
    hidden] and down [E, hidden, inter] (f32, bf16, or int8 / fp8 codes with a scale per
    expert and output channel, [E, out])."""

    gate_up: Any
    down: Any
    gate_up_scale: Any = None
    down_scale: Any = None

    @property
    def arrays(self) -> tuple:
        return self.gate_up, self.down, self.gate_up_scale, self.down_scale

    def map(self, f) -> Stacks:
        return Stacks(*(None if a is None else f(a) for a in self.arrays))

    def pick(self, e) -> Stacks:
        """Expert e's weights (e traced: indexed where they lie, not gathered)."""
        return self.map(lambda a: lax.dynamic_index_in_dim(a, e, keepdims=False))

    @property
    def precision(self):
        # f32 weights take HIGHEST; bf16 and quantized codes widened hold exact products
        # (layers.matmul)
        return HIGHEST if self.gate_up.dtype == jnp.float32 else None

    def mlp(self, x, act, inter: int):
        """The expert's gated MLP: x [..., hidden] with weights [..., out, in] (leading axes
        broadcast against x's): [..., hidden]."""
        gu = _product(self.gate_up, self.gate_up_scale, x, self.precision)
        h = act(gu[..., :inter]) * gu[..., inter:]
        if self.down.dtype == jnp.bfloat16:
            h = lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
        return _product(self.down, self.down_scale, h, self.precision)


def _product(w, scale, x, precision):
    """x [..., in] times w [..., out, in] (widened as it is read), times the scale per output
    channel when quantized: [..., out]."""
    y = jnp.einsum("...oi,...i->...o", w.astype(jnp.float32), x, precision=precision)
    return y if scale is None else y * scale


def shared_weight(x, gate):
    """A shared expert's weight for each row of x [..., hidden]: sigmoid(gate . x) [..., 1],
    gate [1, hidden] f32 (qwen3_5_moe)."""
    return jax.nn.sigmoid(jnp.dot(x, gate[0], precision=HIGHEST))[..., None]


def mixture(moe: Experts, x, router, stacks: Stacks, act, matvec_rows: int, devices: int = 1,
            real=None):
    """The experts' output for x [..., hidden] (the MLP's normed input), [..., hidden], and
    the expert load: the (row, expert) pairs routed to each expert, i32 [experts], counting
    only the rows `real` marks (a call's padding is not a token; every row when None). A bf16
    weight is widened inside its product, its input rounded to bf16 as layers.matmul
    rounds a linear's. `devices` > 1: the experts split over the devices, each holding
    E / devices (expert parallelism; _on_their_devices)."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, hidden)
    weights, chosen = route(moe, flat, router)  # the router reads the unrounded input
    counted = jax.nn.one_hot(chosen, moe.num_experts, dtype=jnp.int32)  # [n, k, experts]
    if real is not None:
        counted = counted * real.astype(jnp.int32)[:, None, None]
    load = jnp.sum(counted, axis=(0, 1))
    return _experts_out(moe, flat, weights, chosen, stacks, act, matvec_rows,
                        devices).reshape(*lead, hidden), load


def _experts_out(moe: Experts, flat, weights, chosen, stacks: Stacks, act, matvec_rows: int,
                 devices: int):
    """mixture's output [n, hidden] for its flat rows."""
    hidden = flat.shape[-1]
    inter = moe.intermediate_size
    if stacks.gate_up.dtype == jnp.bfloat16:
        flat = lax.reduce_precision(flat, exponent_bits=8, mantissa_bits=7)
    if devices > 1:
        return _on_their_devices(flat, weights, chosen, stacks, act, inter, devices,
                                 flat.shape[0] <= matvec_rows)
    if flat.shape[0] <= matvec_rows:
        rows = []
        for r in range(flat.shape[0]):
            out = None
            for j in range(moe.top_k):
                y = stacks.pick(chosen[r, j]).mlp(flat[r], act, inter) * weights[r, j]
                out = y if out is None else out + y
            rows.append(out)
        return jnp.stack(rows)
    n, k, experts = flat.shape[0], moe.top_k, moe.num_experts
    blocks = -(-n * k // EXPERT_BLOCK) + experts  # every expert's rows in whole blocks, at most
    if blocks * EXPERT_BLOCK < experts * n:
        out = _grouped(flat, weights, chosen, stacks, act, inter, blocks)
    else:
        out = _every_expert(flat, weights, chosen, stacks, act, inter)
    return out.reshape(-1, hidden)


# A prompt's rows grouped by expert run in blocks of this many rows, each block one expert's
# (measured on this CPU, 1,024 rows x 16 experts: 32 rows a block 31.2 ms, 64 9.0, 128 11.0)
EXPERT_BLOCK = 64


def _grouped(flat, weights, chosen, stacks: Stacks, act, inter: int, blocks: int):
    """Each (row, chosen expert) pair sorted by expert into blocks of EXPERT_BLOCK rows, every
    expert's pairs in whole blocks of their own; each block runs its expert's MLP (a loop over
    the blocks, the expert's weights indexed, not copied); each pair's output, times its
    routing weight, added into its row. Each expert's weights are read once per block of its
    rows, and the work is the chosen experts' (rounded up to whole blocks)."""
    n, hidden = flat.shape
    k, experts = chosen.shape[1], stacks.gate_up.shape[0]
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
    ys = lax.map(lambda args: stacks.pick(args[1]).mlp(args[0], act, inter),
                 (padded.reshape(blocks, EXPERT_BLOCK, hidden), block_expert))
    pair_out = ys.reshape(-1, hidden)[dest] * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(flat).at[order // k].add(pair_out)


def _on_their_devices(flat, weights, chosen, stacks: Stacks, act, inter: int, devices: int,
                      per_row: bool):
    """Expert parallelism: the stacked experts split over the devices, device d holding
    experts d * E / devices onwards, and every device computing only with the experts it
    holds; the devices' partial outputs meet in one all-reduce (the sum over the device axis).
    A decode call (`per_row`): the stacks viewed as [devices, E / devices, ...], each device
    indexing each row's chosen experts among its own (one it does not hold reads its first
    expert and counts zero). A prompt: every expert over every row, each device its own
    experts (the partitioner keeps the expert axis where it lies)."""
    if not per_row:
        return _every_expert(flat, weights, chosen, stacks, act, inter)
    local_experts = stacks.gate_up.shape[0] // devices
    by_device = stacks.map(lambda a: a.reshape(devices, local_experts, *a.shape[1:]))
    first = jnp.arange(devices, dtype=jnp.int32) * local_experts  # each device's first expert
    rows = []
    for r in range(flat.shape[0]):
        out = None
        for j in range(chosen.shape[1]):
            local = chosen[r, j] - first  # [devices]
            held = (local >= 0) & (local < local_experts)
            at = jnp.clip(local, 0, local_experts - 1)
            mine = by_device.map(lambda a: jnp.take_along_axis(
                a, at.reshape(devices, *(1,) * (a.ndim - 1)), axis=1)[:, 0])
            y = mine.mlp(flat[r], act, inter) * jnp.where(held, weights[r, j], 0.0)[:, None]
            out = y if out is None else out + y
        rows.append(out)
    return jnp.sum(jnp.stack(rows, axis=1), axis=0)


def _every_expert(flat, weights, chosen, stacks: Stacks, act, inter: int):
    """Every expert over every row, weighted by a dense [rows, experts] matrix of routing
    weights (zero off the chosen experts): fewer rows than the grouped blocks would hold."""
    experts = stacks.gate_up.shape[0]
    dense = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32)
                    * weights[..., None], axis=1)  # [n, experts]
    p = stacks.precision
    gu = jnp.einsum("nh,eoh->eno", flat, stacks.gate_up.astype(jnp.float32), precision=p)
    if stacks.gate_up_scale is not None:
        gu = gu * stacks.gate_up_scale[:, None, :]
    h = act(gu[..., :inter]) * gu[..., inter:]
    if stacks.down.dtype == jnp.bfloat16:
        h = lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
    y = jnp.einsum("eni,ehi->enh", h, stacks.down.astype(jnp.float32), precision=p)
    if stacks.down_scale is not None:
        y = y * stacks.down_scale[:, None, :]
    return jnp.einsum("enh,ne->nh", y, dense, precision=HIGHEST)


__all__ = ["EXPERT_BLOCK", "Stacks", "route", "mixture", "shared_weight"]

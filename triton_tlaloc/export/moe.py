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
- On several devices (expert parallelism) each device computes with the experts it holds, a
  decode row with its chosen ones, a prompt's pairs routed to its experts grouped in blocks;
  the partial outputs meet in one all-reduce (_on_their_devices).

Each call also counts the (token, expert) pairs each layer routed (the entry's EXPERT_LOAD).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .config import Experts
from .packed_linear import packed_matvec, packed_values

HIGHEST = lax.Precision.HIGHEST


def route(moe: Experts, x, router):
    """x [n, hidden] f32: each row's routing weights and experts, [n, k] each, largest first."""
    logits = jnp.dot(x, router.T, precision=HIGHEST)
    top, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), moe.top_k)
    if moe.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts


@dataclass(frozen=True)
class ExpertWeight:
    """One stacked expert weight as the entry holds it, [E, out, in]: its arrays by suffix, ""
    the values (f32, bf16) or codes, ".scale" an int8 / fp8 scale per expert and output
    channel [E, out]; or, `packed` (a packed type: gguf_packed), each expert's packed arrays
    stacked ("", ".high", ".scale", ".offset"; packed_linear reads them)."""

    arrays: Mapping[str, Any]
    packed: str | None = None

    @classmethod
    def of(cls, w: Mapping, name: str, packed: str | None) -> ExpertWeight:
        return cls({k[len(name):]: a for k, a in w.items()
                    if k == name or k.startswith(name + ".")}, packed)

    def map(self, f) -> ExpertWeight:
        return ExpertWeight({k: f(a) for k, a in self.arrays.items()}, self.packed)

    @property
    def dtype(self):
        return jnp.float32 if self.packed else self.arrays[""].dtype

    @property
    def scale(self):
        """An int8 / fp8 weight's scale per expert and output channel (a packed weight's scales
        are inside its values): None when there is none."""
        return None if self.packed else self.arrays.get(".scale")

    @property
    def precision(self):
        # f32 values (a packed weight's widened ones too) take HIGHEST; bf16 and int8 / fp8
        # codes widened hold exact products (layers.matmul)
        return HIGHEST if self.dtype == jnp.float32 else None

    def __call__(self, x):
        """x [..., in] times the weight [..., out, in] (leading axes broadcast against x's):
        [..., out]. One row of a packed weight: a product per band, each fused with its
        band's widening (only its bytes are read)."""
        if self.packed and x.ndim == 1:
            return packed_matvec(self.packed, self.arrays, x)
        y = jnp.einsum("...oi,...i->...o", self.values(), x, precision=self.precision)
        return y if self.scale is None else y * self.scale

    def values(self):
        """f32 [..., out, in]: a packed weight's values, or the values or codes widened (the
        scale not applied)."""
        if self.packed:
            return packed_values(self.packed, self.arrays)
        return self.arrays[""].astype(jnp.float32)

    def every_expert(self, x):
        """Every expert over the rows of x, [n, in] (the same rows for each) or [E, n, in]
        (each expert's own): [E, n, out]."""
        spec = "ni,eoi->eno" if x.ndim == 2 else "eni,eoi->eno"
        y = jnp.einsum(spec, x, self.values(), precision=self.precision)
        return y if self.scale is None else y * self.scale[:, None, :]


@dataclass(frozen=True)
class Stacks:
    """A sparse layer's stacked experts: gate|up [E, 2 * inter, hidden] and down
    [E, hidden, inter] (ExpertWeight)."""

    gate_up: ExpertWeight
    down: ExpertWeight

    def map(self, f) -> Stacks:
        return Stacks(self.gate_up.map(f), self.down.map(f))

    def pick(self, e) -> Stacks:
        """Expert e's weights (e traced: indexed where they lie, not gathered)."""
        return self.map(lambda a: lax.dynamic_index_in_dim(a, e, keepdims=False))

    @property
    def experts(self) -> int:
        return self.gate_up.arrays[""].shape[0]

    def mlp(self, x, act, inter: int):
        """The expert's gated MLP: x [..., hidden] with weights [..., out, in] (leading axes
        broadcast against x's): [..., hidden]."""
        gu = self.gate_up(x)
        h = _rounded(act(gu[..., :inter]) * gu[..., inter:], self.down)
        return self.down(h)


def _rounded(h, w: ExpertWeight):
    """A bf16 weight's input rounded to bf16, as layers.matmul rounds a linear's."""
    if w.dtype == jnp.bfloat16:
        return lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
    return h


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
    flat = _rounded(flat, stacks.gate_up)
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
    blocks = _blocks(n * k, experts)
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
    rows, and the work is the chosen experts' (rounded up to whole blocks). A pair whose expert
    is not among the stacks' (chosen >= their count: another device's) is left out."""
    n, hidden = flat.shape
    k, experts = chosen.shape[1], stacks.experts
    pair_expert = chosen.reshape(-1)
    order = jnp.argsort(pair_expert, stable=True)
    sorted_expert = pair_expert[order]
    held = sorted_expert < experts
    counts = jnp.sum(jax.nn.one_hot(pair_expert, experts, dtype=jnp.int32), axis=0)
    expert_blocks = (counts + EXPERT_BLOCK - 1) // EXPERT_BLOCK
    first_block = jnp.cumsum(expert_blocks) - expert_blocks
    first_pair = jnp.cumsum(counts) - counts
    at = jnp.minimum(sorted_expert, experts - 1)
    rank = jnp.arange(n * k, dtype=jnp.int32) - first_pair[at]
    # the pair's row in the blocks; one left out, past the last block
    dest = jnp.where(held, first_block[at] * EXPERT_BLOCK + rank, blocks * EXPERT_BLOCK)
    padded = jnp.zeros((blocks * EXPERT_BLOCK, hidden), flat.dtype).at[dest].set(
        flat[order // k], mode="drop")
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(expert_blocks),
                                                jnp.arange(blocks), side="right"), experts - 1)
    ys = lax.map(lambda args: stacks.pick(args[1]).mlp(args[0], act, inter),
                 (padded.reshape(blocks, EXPERT_BLOCK, hidden), block_expert))
    pair_out = (ys.reshape(-1, hidden).at[dest].get(mode="fill", fill_value=0.0)
                * jnp.where(held, weights.reshape(-1)[order], 0.0)[:, None])
    return jnp.zeros_like(flat).at[order // k].add(pair_out)


def _blocks(pairs: int, experts: int) -> int:
    """The blocks a call's (row, expert) pairs take grouped by expert, at most: each expert's
    in whole blocks."""
    return -(-pairs // EXPERT_BLOCK) + experts


def _on_their_devices(flat, weights, chosen, stacks: Stacks, act, inter: int, devices: int,
                      per_row: bool):
    """Expert parallelism: the stacked experts split over the devices, device d holding
    experts d * E / devices onwards, and every device computing only with the experts it
    holds; the devices' partial outputs meet in one all-reduce (the sum over the device axis).
    The stacks are viewed as [devices, E / devices, ...], so the device axis is a whole axis
    of every operation on them and the partitioner moves no weight.
    A decode call (`per_row`): each device indexes each row's chosen experts among its own
    (one it does not hold reads its first expert and counts zero). A prompt: each device groups
    the pairs routed to its experts into blocks (_grouped, in blocks enough for every pair on
    one device), or, with fewer rows than those blocks would hold, runs each of its experts
    over every row."""
    local_experts = stacks.experts // devices
    by_device = stacks.map(lambda a: a.reshape(devices, local_experts, *a.shape[1:]))
    first = jnp.arange(devices, dtype=jnp.int32) * local_experts  # each device's first expert
    if not per_row:
        n, k = chosen.shape
        blocks = _blocks(n * k, local_experts)
        if blocks * EXPERT_BLOCK >= local_experts * n:
            return _every_expert(flat, weights, chosen, stacks, act, inter)

        def on_device(gate_up, down, first_expert):
            own = Stacks(ExpertWeight(gate_up, stacks.gate_up.packed),
                         ExpertWeight(down, stacks.down.packed))
            local = chosen - first_expert
            mine = (local >= 0) & (local < local_experts)
            return _grouped(flat, weights, jnp.where(mine, local, local_experts), own, act,
                            inter, blocks)
        return jnp.sum(jax.vmap(on_device)(dict(by_device.gate_up.arrays),
                                           dict(by_device.down.arrays), first), axis=0)
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
    dense = jnp.sum(jax.nn.one_hot(chosen, stacks.experts, dtype=jnp.float32)
                    * weights[..., None], axis=1)  # [n, experts]
    gu = stacks.gate_up.every_expert(flat)
    h = _rounded(act(gu[..., :inter]) * gu[..., inter:], stacks.down)
    y = stacks.down.every_expert(h)
    return jnp.einsum("enh,ne->nh", y, dense, precision=HIGHEST)


__all__ = ["EXPERT_BLOCK", "ExpertWeight", "Stacks", "route", "mixture", "shared_weight"]

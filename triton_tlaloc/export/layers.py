"""The decoder graph's parts in JAX, one function each; decoder.make_entry_fn strings them
together into the function an entry lowers.

    embed          token ids to f32 hidden states (a tied, transposed or quantized table too)
    layer_loop     every layer as one loop over stacked weights and pools (alike layers)
    decoder_layer  RMSNorm, the layer's mixer and the residual, then the MLP
    attention      q|k|v, [q/k RMSNorm], RoPE, the KV write, paged attention, [gate], o_proj
    linear_mixer   a Gated DeltaNet layer: its states gathered, conv, delta rule, states written
    mlp            RMSNorm, gate|up, activation, down, residual
    head           the final norm and the logits of each row's last token (head_all_positions:
                   after every position, for verify entries)

These functions only trace: they take one call's traced values and return new ones. The
order in which they emit operations is the order of the lowered StableHLO, so moving an
operation changes the artifact's bytes even when every value stays the same. JAX is imported
here at the top: decoder.py imports this module only when it lowers an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import linear_attention as la_ops
from .attention import FP8, FP8_BITS, LayerPool, by_length, from_bits, one_pass, ring, to_bits
from .config import DecoderConfig
from .gguf_packed import is_packed
from .lora_graph import lora_update
from .moe import ExpertWeight, Stacks, mixture, shared_weight
from .packed_linear import ONE_DEVICE, PackedShards, gathered_rows, packed_product
from ..artifact.manifest import WindowedKv

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}

# Rows of a decode call up to this many run as one matrix-vector product each (an [out, in]
# artifact): XLA fuses each into a read of the weight, where a GEMM would first widen the whole
# weight to f32. A weight small enough to stay in the last-level cache is read from memory once
# for all the rows.
MATVEC_ROWS = 8
# A product of more rows than this reads a linear's [in, out] copy where the layer loop has
# one (decoder.in_out_copies): at 2 rows both cost the same through SmolLM2's entry, at 4 the
# copy's products take 0.43x (docs/performance.md,
# "A buffer per layer and a smaller key block for many rows").
IN_OUT_ROWS = 2


@dataclass(frozen=True)
class Graph:
    """What every part of one entry's graph reads besides the call's values: the model's config,
    each weight's slot by name (decoder.WeightSlot) and the export's choices."""

    cfg: DecoderConfig
    slot_of: dict
    bf16: bool  # bf16 weights: a linear's input is rounded to bf16
    block_size: int
    num_blocks: int  # pages of each full pool
    key_blocks: tuple[int, ...]  # this entry's key blocks of blockwise attention, ascending
    windowed: WindowedKv | None
    num_state_slots: int
    # Devices a tensor-parallel program runs on: its fused products hold each device's part
    # of every fused part, one device after another (split_fused).
    shards: int = 1
    # A tensor-parallel program's split packed weights by part ("qkv", "down", "embed"): how
    # each is divided over the devices (packed_linear.PackedShards)
    packed_shards: Mapping[str, PackedShards] = field(default_factory=dict)
    # LoRA adapters (model.lora): each adapted part's devices and modules' outputs on one
    # ("qkv": (1, (q, k, v)) on one device; lora.layout.graph_pieces)
    lora_pieces: Mapping[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def shards_of(self, name: str) -> PackedShards:
        """A packed slot's division over the devices by its name ("l3.qkv", "lm_head")."""
        from .decoder import slot_part

        return self.packed_shards.get(slot_part(name), ONE_DEVICE)

    @property
    def eps(self) -> np.float32:
        return np.float32(self.cfg.rms_norm_eps)

    @property
    def transposed_table(self) -> bool:
        """A tied f32 table, stored [hidden, vocab] (decoder.weight_slots)."""
        return "embed_t" in self.slot_of

    def on_ring(self, layer: int) -> bool:
        """Whether a layer's KV lives in the windowed pool's rings."""
        return self.windowed is not None and layer in self.windowed.layers


@dataclass
class Step:
    """One call's step inputs as the layers read them, with what is derived from them once per
    call: the flat scatter indices of the KV writes and each RoPE's cos and sin."""

    positions: Any
    seq_lens: Any
    block_tables: Any
    kv_slots: Any  # [b * t (+1)] into the full pools
    pad_row: bool  # one token: the scatters carry a second, dropped row
    window_tables: Any = None
    window_slots: Any = None  # [b * t (+1)] into the windowed pools
    ring_width: int = 0  # the ring's entries of a window table
    state_slots: Any = None
    rotary: dict = field(default_factory=dict)  # inv_freq -> (cos, sin)
    real: Any = None  # [b * t] bool: the call's tokens that are not padding
    # each sparse layer's expert load [experts] (i32), in layer order, as the layers are traced
    expert_loads: list = field(default_factory=list)
    # LoRA adapters (model.lora): each row's slot [b] (0 none), each adapted part's pools
    # (A, B), whole ([layers, slots, ...]), and the layer loop's traced layer index
    lora_slots: Any = None
    lora_pools: dict = field(default_factory=dict)
    loop_layer: Any = None
    # A mixed call: its tokens are one row (the decode rows', then the chunk's) and each group
    # attends over its own block tables (None: the call's rows are its rows)
    groups: tuple["AttentionGroup", ...] | None = None


@dataclass(frozen=True)
class LayerWeights:
    """One linear's [in, out] copy inside the layer loop: a buffer per layer, and the loop's
    traced layer. A product on a slice of a stacked weight copies the slice out first (XLA's
    CPU backend: 16 rows through every layer's linears 1.75x the time); a switch on the layer
    runs the product on that layer's own buffer."""

    each: tuple
    layer: Any

    def product(self, x, bf16: bool):
        return lax.switch(self.layer, [lambda x, w=w: matmul(x, w, False, bf16)
                                       for w in self.each], x)


@dataclass(frozen=True)
class AttentionGroup:
    """Rows of a mixed call that attend alike: `rows` rows of `tokens` tokens each, at these
    positions [rows, tokens], through these block tables [rows, pages] and lengths [rows];
    with a windowed pool, a sliding layer through these window tables [rows, ring width];
    with state pools, a linear layer over these state slots [rows]."""

    rows: int
    tokens: int
    positions: Any
    block_tables: Any
    seq_lens: Any
    window_tables: Any = None
    state_slots: Any = None


def make_step(g: Graph, token_ids, positions, block_tables, seq_lens, slot_mapping,
              window_tables=None, window_slots=None, state_slots=None) -> Step:
    """The call's Step; computes the KV writes' indices (the full pools', then the rings')."""
    b, t = token_ids.shape
    # XLA turns a scatter of one index into a dynamic-update-slice on a copy of the pool (a
    # whole-pool copy per layer and step: measured 0.8 ms per 1.5 MiB pool). A second index,
    # past the end and so dropped, keeps it a scatter, done in place.
    pad_row = b * t == 1
    kv_slots = _scatter_slots(slot_mapping, g.num_blocks * g.block_size, pad_row)
    real = slot_mapping.reshape(-1) >= 0 if g.cfg.moe is not None else None
    if g.windowed is None:
        return Step(positions, seq_lens, block_tables, kv_slots, pad_row,
                    state_slots=state_slots, real=real)
    ring_slots = _scatter_slots(window_slots, g.windowed.num_blocks * g.block_size, pad_row)
    return Step(positions, seq_lens, block_tables, kv_slots, pad_row, window_tables, ring_slots,
                min(block_tables.shape[1], g.windowed.ring_pages), state_slots, real=real)


def flat_tokens(decode_ids, chunk_ids):
    """A mixed call's tokens as one row [1, R + T]: the decode rows', then the chunk's."""
    return jnp.concatenate([decode_ids.reshape(-1), chunk_ids.reshape(-1)])[None]


def make_mixed_step(g: Graph, decode, chunk, rings=None, states=None) -> Step:
    """A mixed call's Step: every token in one row for the linears, the KV written at the
    decode rows' and the chunk's slots in one scatter (a sliding layer's at their ring slots),
    and two attention groups, the decode rows (R x 1) and the chunk (1 x T). `decode` and
    `chunk`: (token ids, positions, block tables, lengths, slot mapping) each; `rings` with a
    windowed pool: the decode rows' (window tables, window slots), then the chunk's; `states`
    with state pools: the decode rows' state slots, then the chunk's."""
    _, positions, tables, lens, slots = decode
    _, chunk_positions, chunk_tables, chunk_lens, chunk_slots = chunk
    rows = positions.shape[0]
    flat_slots = flat_tokens(slots, chunk_slots)
    kv_slots = _scatter_slots(flat_slots, g.num_blocks * g.block_size, False)
    width, ring_slots, ring_tables = 0, None, (None, None)
    if rings is not None:
        (tables_r, slots_r), (chunk_tables_r, chunk_slots_r) = rings
        width = min(tables.shape[1], g.windowed.ring_pages)
        ring_tables = (tables_r[:, :width], chunk_tables_r[:, :width])
        ring_slots = _scatter_slots(flat_tokens(slots_r, chunk_slots_r),
                                    g.windowed.num_blocks * g.block_size, False)
    state_slots = states if states is not None else (None, None)
    groups = (AttentionGroup(rows, 1, positions, tables, lens, ring_tables[0], state_slots[0]),
              AttentionGroup(1, chunk_positions.shape[1], chunk_positions, chunk_tables,
                             chunk_lens, ring_tables[1], state_slots[1]))
    real = flat_slots.reshape(-1) >= 0 if g.cfg.moe is not None else None
    return Step(flat_tokens(positions, chunk_positions), None, None, kv_slots, False,
                window_slots=ring_slots, ring_width=width, real=real, groups=groups)


def mixed_last_tokens(x, rows: int):
    """The hidden states a mixed call's logits are read from, [R + 1, 1, hidden]: each decode
    row's token and the chunk's last (the head reads each row's last token)."""
    return jnp.concatenate([x[0, :rows], x[0, -1:]])[:, None, :]


def _scatter_slots(mapping, pool_slots: int, pad_row: bool):
    """A slot mapping as scatter indices. Padding tokens carry slot -1; JAX wraps negative
    scatter indices, so they are sent past the pool's end, where mode="drop" skips them: their
    KV is never written."""
    flat = mapping.reshape(-1)
    flat = jnp.where(flat < 0, pool_slots, flat)
    if pad_row:
        flat = jnp.concatenate([flat, jnp.array([pool_slots], jnp.int32)])
    return flat


def rms_norm(x, w, eps):
    """RMSNorm over the last axis, in f32; the weight as stored (gemma's 1 + weight is folded
    in at export)."""
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return (x * lax.rsqrt(var + eps)) * w


def computed_once(x):
    """x computed once, before a product: a reduce is a fusion boundary, and adding zero changes
    no value. Without it XLA fuses the norm (and the rounding) into the matrix-vector product
    and recomputes them for every output: SmolLM2 bf16 layers at 4 rows 56 ms against 27 ms, at
    1 row 15 ms against 10.7 ms (docs/performance.md)."""
    return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)


def matmul(x, w, out_first: bool, bf16: bool):
    """x times a stored weight, [in, out] or [out, in] (`out_first`), summed in f32."""
    if bf16:  # bf16 weights: the input is rounded to bf16, products sum in f32
        # reduce_precision rounds exactly as a bf16 round trip does, but XLA fuses a round trip
        # of converts into every output of a matrix-vector product (SmolLM2 bf16 at one row:
        # 22.4 ms against 11.9 ms).
        x = lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    x = computed_once(x)
    if not out_first:  # f32 [in, out]
        return jnp.matmul(x, w, precision=lax.Precision.HIGHEST)
    # A bf16 artifact's [out, in] weights (decoder.out_first_linears) and the rounded input hold
    # bf16 values: their products are exact in f32 and TF32, so no precision=HIGHEST, with which
    # XLA's CPU matrix-vector emitter is 1.3x slower.
    # An f32 [out, in] weight (the layer loop's) holds f32 values: its products take HIGHEST.
    precision = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    wf = w.astype(jnp.float32)  # fused into the reads below, never materialized at one row
    lead, n_in = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, n_in)
    if flat.shape[0] <= MATVEC_ROWS:
        out = jnp.stack([jnp.dot(wf, r, precision=precision) for r in flat])
    else:
        out = lax.dot_general(flat, wf, (((1,), (1,)), ((), ())), precision=precision)
    return out.reshape(*lead, w.shape[0])


def rows_of(x) -> int:
    """The rows a product over x's last axis runs."""
    return int(np.prod(x.shape[:-1]))


def project(g: Graph, x, w: dict, name: str, step: Step | None = None):
    """A linear by slot name, in its slot's layout; quantized codes are widened in front of the
    product (exact) and each output column is multiplied by its scale. With adapter pools
    beside the weight (`<name>.lora_a`), each row's adapter's update added (`step`'s
    lora_slots; export/lora_graph.py). A linear of the layer loop with an [in, out] copy
    (`<name>.in_out`, a LayerWeights) is read there by products of more than IN_OUT_ROWS
    rows."""
    from .decoder import IN_OUT, slot_layer, slot_part

    slot = g.slot_of[name]
    copy = w.get(f"{name}{IN_OUT}")
    if is_packed(slot.quant):  # widened inside the product's reads (export/packed_linear.py)
        y = packed_product(computed_once(x), slot.quant, w, name, MATVEC_ROWS,
                           g.shards_of(name))
    elif copy is not None and rows_of(x) > IN_OUT_ROWS:
        y = copy.product(x, g.bf16)
    else:
        y = matmul(x, w[name], slot.out_first, g.bf16)
        if slot.quant is not None:
            y = y * w[f"{name}.scale"]
    part = slot_part(name)
    if step is not None and part in step.lora_pools:
        layer = step.loop_layer if step.loop_layer is not None else slot_layer(name)
        devices, pieces = g.lora_pieces[part]
        y = y + adapter_update(step, x, part, layer, pieces, devices)
    return y


def adapter_update(step: Step, x, part: str, layer, pieces, devices: int):
    """Each row's adapter update of one adapted part (export/lora_graph.py). A mixed call's
    groups are updated with their own rows' slots (step.lora_slots holds the decode rows',
    then the chunk's), as the calls apart would."""
    pools = step.lora_pools[part]
    if step.groups is None:
        return lora_update(x, *pools, layer, step.lora_slots, pieces, devices)
    return per_group(step.groups, x, lambda grp, first_row, rows: lora_update(
        rows, *pools, layer, step.lora_slots[first_row:first_row + grp.rows], pieces, devices))


def per_group(groups, x, fn):
    """`fn` over each group of a mixed call's one row of tokens x [1, tokens, ...]: called
    with (the group, its first row, its tokens as [rows, tokens, ...]), its results [rows,
    tokens, ...] joined back into one row, in order."""
    outs, start, first_row = [], 0, 0
    for grp in groups:
        n = grp.rows * grp.tokens
        out = fn(grp, first_row, x[:, start:start + n].reshape(grp.rows, grp.tokens,
                                                               *x.shape[2:]))
        outs.append(out.reshape(1, n, *out.shape[2:]))
        start, first_row = start + n, first_row + grp.rows
    return jnp.concatenate(outs, axis=1)


def split_fused(g: Graph, x, widths):
    """A fused product's parts along its last axis, `widths` wide each. In a tensor-parallel
    program the product holds device 0's part of each, then device 1's ... (sharding.Split):
    it is viewed per device, each part's columns taken from every device, so each part keeps
    its devices' columns in order and the partitioner moves nothing between devices."""
    if g.shards == 1:
        parts, start = [], 0
        for w in widths:
            parts.append(x[..., start:start + w])
            start += w
        return parts
    lead, n = x.shape[:-1], g.shards
    per_device = x.reshape(*lead, n, x.shape[-1] // n)
    parts, start = [], 0
    for w in widths:
        parts.append(per_device[..., start:start + w // n].reshape(*lead, w))
        start += w // n
    return parts


def to_pool(x, dtype):
    """Keys and values as a pool stores them. An fp8 (e4m3fn) pool has no scale: a value is
    stored as itself, clamped to +-448 (e4m3fn has no infinity: a larger value would be NaN),
    and written as its code's byte: the program holds the pool as bytes (manifest.BITS;
    `dtype` is then uint8). Attention widens the codes to f32 as it reads them."""
    if dtype in (FP8, FP8_BITS):
        codes = jnp.clip(x, -448.0, 448.0).astype(FP8)
        return to_bits(codes) if dtype == FP8_BITS else codes
    return x.astype(dtype)


def embed(g: Graph, w: dict, token_ids):
    """Each token's row of the embedding table, f32 [b, t, hidden]."""
    quant = g.slot_of["embed"].quant if "embed" in g.slot_of else None
    if g.transposed_table:  # columns of the [hidden, vocab] table
        x = jnp.moveaxis(jnp.take(w["embed_t"], token_ids, axis=1), 0, -1)
    elif is_packed(quant):  # rows of a GGUF-packed table, widened after the gather
        x = gathered_rows(quant, w, "embed", token_ids, g.shards_of("embed").devices)
    else:
        x = jnp.take(w["embed"], token_ids, axis=0).astype(jnp.float32)
        if "embed.scale" in w:  # a quantized tied table: each gathered row times its scale
            x = x * jnp.take(w["embed.scale"], token_ids, axis=0)[..., None]
    x = x.astype(jnp.float32)
    if g.cfg.embed_scale is not None:
        x = x * np.float32(g.cfg.embed_scale)
    return x


def layer_loop(g: Graph, step: Step, w: dict, x, k_pool, v_pool):
    """Every layer as one lax.scan over the stacked weights ("layers.<part>", the layer on the
    first axis), with the stacked K and V pools as the loop's carry, each layer's keys and
    values scattered into them in place. The loop body is layer 0's graph: the layers are
    alike (decoder.loops_layers), so layer 0's config, RoPE and slots stand for every layer.
    A linear's [in, out] copies (one buffer per layer, decoder.in_out_copies) come in whole
    and each layer's product picks its own (LayerWeights); a call of few rows leaves them
    out (never read). Returns (x, (k_pool, v_pool))."""
    from .decoder import IN_OUT, STACKED

    stacked = {name[len(STACKED):]: a for name, a in w.items() if name.startswith(STACKED)}
    copies = {} if rows_of(x) <= IN_OUT_ROWS else {
        part: tuple(w[f"l{i}.{part}{IN_OUT}"] for i in range(g.cfg.num_layers))
        for part in stacked if f"l0.{part}{IN_OUT}" in w}
    cos_sin(g.cfg, step, 0)  # RoPE's tables once, before the loop

    def body(carry, xs):
        x, k_all, v_all = carry
        layer, parts = xs
        # A bf16 or f8 weight came in as its bits (manifest.BITS): its own type again
        # here, after the slice, where the product fuses the widening into its reads.
        # (A packed weight's bytes are its codes, not f8 bits.)
        w_layer = {f"l0.{part}": a if is_packed(g.slot_of[f"l0.{part}"].quant) else from_bits(a)
                   for part, a in parts.items()}
        w_layer.update({f"l0.{part}{IN_OUT}": LayerWeights(each, layer)
                        for part, each in copies.items()})
        traced = len(step.expert_loads)
        step.loop_layer = layer  # (the adapter pools are read by it: model.lora)
        x, k, v = decoder_layer(g, step, w_layer, 0, x, LayerPool(k_all, layer),
                                LayerPool(v_all, layer))
        step.loop_layer = None
        load = step.expert_loads.pop() if len(step.expert_loads) > traced else None
        return (x, k.stacked, v.stacked), load  # a sparse layer's load, out of the loop

    layer_ids = jnp.arange(g.cfg.num_layers, dtype=jnp.int32)
    (x, k_pool, v_pool), loads = lax.scan(body, (x, k_pool, v_pool), (layer_ids, stacked))
    if loads is not None:  # [layers, experts]: every layer's, in order
        step.expert_loads.extend(loads)
    return x, (k_pool, v_pool)


def decoder_layer(g: Graph, step: Step, w: dict, i: int, x, pool_a, pool_b):
    """Layer i: RMSNorm, the mixer (attention, or a linear layer of a hybrid model) added to the
    residual, then the MLP. The pools are the layer's K and V, or its conv and recurrent states;
    returns (x, pool_a, pool_b) updated."""
    hdn = rms_norm(x, w[f"l{i}.attn_norm"], g.eps)
    mixer = linear_mixer if g.cfg.is_linear(i) else attention
    out, pool_a, pool_b = mixer(g, step, w, i, hdn, pool_a, pool_b)
    return mlp(g, step, w, i, x + out), pool_a, pool_b


def mlp(g: Graph, step: Step, w: dict, i: int, x):
    """RMSNorm, the gated MLP (SwiGLU, or gemma's GELU-tanh) or a mixture of experts, [post
    norm], residual."""
    cfg = g.cfg
    hdn = rms_norm(x, w[f"l{i}.mlp_norm"], g.eps)
    if cfg.is_sparse(i):  # a mixture of experts (export/moe.py)
        quants = {name: g.slot_of[name].quant
                  for name in (f"l{i}.experts_gate_up", f"l{i}.experts_down")}
        stacks = Stacks(*(ExpertWeight.of(w, name, q if is_packed(q) else None)
                          for name, q in quants.items()))
        out, load = mixture(cfg.moe, computed_once(hdn), w[f"l{i}.router"], stacks,
                            ACTIVATIONS[cfg.activation], MATVEC_ROWS, g.shards, step.real)
        step.expert_loads.append(load)
        if cfg.moe.shared_intermediate_size:  # + sigmoid(gate . x) * the shared expert's MLP
            gu = project(g, hdn, w, f"l{i}.shared_gate_up")
            gate, up = split_fused(g, gu, (cfg.moe.shared_intermediate_size,) * 2)
            shared = project(g, ACTIVATIONS[cfg.activation](gate) * up, w, f"l{i}.shared_down")
            out = out + shared_weight(hdn, w[f"l{i}.shared_gate"]) * shared
        return x + out
    gu = project(g, hdn, w, f"l{i}.gate_up", step)
    gate, up = split_fused(g, gu, (cfg.intermediate_size,) * 2)
    out = project(g, ACTIVATIONS[cfg.activation](gate) * up, w, f"l{i}.down", step)
    if cfg.sandwich_norms:
        out = rms_norm(out, w[f"l{i}.post_mlp_norm"], g.eps)
    return x + out


def head(g: Graph, w: dict, x):
    """The final norm and the logits of each row's last token (rows are right-aligned), f32
    [b, vocab]."""
    return head_projection(g, w, rms_norm(x[:, -1, :], w["final_norm"], g.eps))


def head_all_positions(g: Graph, w: dict, x):
    """The final norm and the logits after every position of every row, f32 [b, t, vocab]: a
    verify entry's, whose draft tokens are each checked against the prediction before them."""
    return head_projection(g, w, rms_norm(x, w["final_norm"], g.eps))


def argmax_ids(logits):
    """The argmax over the vocabulary at each position, i32 (the first of equal maxima, as
    numpy's and torch's argmax take)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def head_projection(g: Graph, w: dict, normed):
    """The head's product on normed hidden states [..., hidden]: logits [..., vocab]. A tied
    model's head reads the embedding table, the same buffer as the gather."""
    if g.transposed_table:
        return matmul(normed, w["embed_t"], False, g.bf16)
    if g.cfg.tie_word_embeddings:  # [vocab, hidden] is the head's [out, in]
        return project(g, normed, w, "embed")  # (scaled per vocab row when quantized)
    return project(g, normed, w, "lm_head")


# ------------------------------------------------------------------ attention layers

def attention(g: Graph, step: Step, w: dict, i: int, hdn, k_pool, v_pool):
    """An attention layer's output (before the residual) and its K and V pools with the call's
    keys and values written."""
    cfg = g.cfg
    q, k, v, gate = qkv_heads(g, w, i, hdn, step)
    cos, sin = cos_sin(cfg, step, i)
    q, k = rope(q, cos, sin, cfg), rope(k, cos, sin, cfg)
    on_ring = g.on_ring(i)
    k_pool = write_kv(g, step, k_pool, k, on_ring)
    v_pool = write_kv(g, step, v_pool, v, on_ring)
    out = paged_attention(g, step, i, q, k_pool, v_pool)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    out = project(g, out, w, f"l{i}.o", step)
    if cfg.sandwich_norms:
        out = rms_norm(out, w[f"l{i}.post_attn_norm"], g.eps)
    return out, k_pool, v_pool


def qkv_heads(g: Graph, w: dict, i: int, hdn, step: Step | None = None):
    """The fused q|k|v projection split into heads, [b, t, heads, d], with q/k RMSNorm where the
    family has it; the output gate [b, t, heads * d] (None without one)."""
    cfg = g.cfg
    b, t, _ = hdn.shape
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    qkv = project(g, hdn, w, f"l{i}.qkv", step)
    q_width = 2 * heads * d if cfg.attn_output_gate else heads * d
    q, k, v = split_fused(g, qkv, (q_width, kv_heads * d, kv_heads * d))
    gate = None
    if cfg.attn_output_gate:  # per head: [query (d), gate (d)]
        qg = q.reshape(b, t, heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, heads * d)
    else:
        q = q.reshape(b, t, heads, d)
    k = k.reshape(b, t, kv_heads, d)
    v = v.reshape(b, t, kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, w[f"l{i}.q_norm"], g.eps)
        k = rms_norm(k, w[f"l{i}.k_norm"], g.eps)
    return q, k, v, gate


def cos_sin(cfg: DecoderConfig, step: Step, layer: int):
    """The RoPE cos and sin of a layer at the call's positions, [b, t, 1, rotary dim]; computed
    once per call for each distinct RoPE (gemma3: one for sliding layers, one for full)."""
    key = tuple(cfg.inv_freq(layer).tolist())
    if key not in step.rotary:
        freqs = step.positions.astype(jnp.float32)[..., None] * jnp.asarray(cfg.inv_freq(layer))
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
        step.rotary[key] = (jnp.cos(emb), jnp.sin(emb))
    return step.rotary[key]


def rope(x, cos, sin, cfg: DecoderConfig):
    """RoPE over each head's first rotary dims (rotate-half); a partial rotary (qwen3_5) passes
    the rest through."""
    rotary_dim = cfg.rotary_dim or cfg.head_size
    xr, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return jnp.concatenate([xr * cos + rotated * sin, rest], axis=-1)


def write_kv(g: Graph, step: Step, pool, new, on_ring: bool):
    """KV_CACHE_WRITE: each token's key (or value) scattered at its slot, in a sliding layer's
    ring at its slot in the windowed pool; padding tokens' slots are dropped."""
    kv_heads, d = g.cfg.num_kv_heads, g.cfg.head_size
    idx = step.window_slots if on_ring else step.kv_slots
    shape = pool.shape
    rows = new.reshape(-1, kv_heads, d)
    if step.pad_row:  # the second, dropped row that keeps the scatter in place
        rows = jnp.concatenate([rows, jnp.zeros_like(rows)])
    rows = to_pool(rows, pool.dtype)
    if isinstance(pool, LayerPool):  # (page, layer, offset); padding's page is past the end
        page, offset = idx // g.block_size, idx % g.block_size
        return LayerPool(pool.stacked.at[page, pool.layer, offset].set(rows, mode="drop"),
                         pool.layer)
    slots = pool.reshape(shape[0] * g.block_size, kv_heads, d)
    return slots.at[idx].set(rows, mode="drop").reshape(shape)


def paged_attention(g: Graph, step: Step, i: int, q, k_pool, v_pool):
    """PAGED_ATTENTION, [b, t, heads * d]: a call whose context is one key block gathers a
    row's pages once and every token of the row attends over them with its own causal length;
    a call over several key blocks attends one block at a time, up to the block holding its
    last live position, in blocks chosen by how many positions the call holds; a sliding layer
    scores only its ring, masking each slot by its age (attention.py)."""
    cfg = g.cfg
    b, t = q.shape[:2]
    width = cfg.num_heads * cfg.head_size
    if step.groups is not None:  # a mixed call: each group over its own tables, in order
        def group_attention(grp, _, part):
            if g.on_ring(i):
                return _ring_attention(g, i, part, k_pool, v_pool, grp.window_tables,
                                       grp.positions, grp.seq_lens)
            return _full_attention(g, i, part, k_pool, v_pool, grp.block_tables,
                                   grp.positions, grp.seq_lens)
        return per_group(step.groups, q, group_attention).reshape(1, -1, width)
    if g.on_ring(i):
        out = _ring_attention(g, i, q, k_pool, v_pool, step.window_tables[:, :step.ring_width],
                              step.positions, step.seq_lens)
    else:
        out = _full_attention(g, i, q, k_pool, v_pool, step.block_tables, step.positions,
                              step.seq_lens)
    return out.reshape(b, t, width)


def _ring_attention(g: Graph, i: int, q, k_pool, v_pool, ring_tables, positions, seq_lens):
    """A sliding layer's attention of q [b, t, heads, d] over the rings the tables name."""
    cfg = g.cfg
    b, t = q.shape[:2]
    qg = q.reshape(b, t, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_size)
    return ring(qg, k_pool, v_pool, ring_tables, positions, seq_lens, cfg.window(i),
                g.windowed.ring_pages * g.block_size, cfg.attn_scale)


def _full_attention(g: Graph, i: int, q, k_pool, v_pool, block_tables, positions, seq_lens):
    """Attention of q [b, t, heads, d] over the pages the block tables name: one pass when
    the tables span one key block, else block by block."""
    cfg = g.cfg
    b, t = q.shape[:2]
    qg = q.reshape(b, t, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_size)
    window, scale = cfg.window(i), cfg.attn_scale
    if block_tables.shape[1] * g.block_size > g.key_blocks[0]:
        return by_length(qg, k_pool, v_pool, block_tables, positions, seq_lens, g.key_blocks,
                         window, scale)
    return one_pass(qg, k_pool, v_pool, block_tables, positions, seq_lens, window, scale)


# ------------------------------------------------------------------ Gated DeltaNet layers

def linear_mixer(g: Graph, step: Step, w: dict, i: int, hdn, conv_pool, rec_pool):
    """A Gated DeltaNet layer over the call's rows, and its state pools updated: each row's
    states are read at its state slot, the row's live tokens run through the conv and the rule,
    and the states are written back (docs/design.md#linear-attention-state-slots).
    linear_attention.py has the ops. A mixed call's projections run over its one row of
    tokens, the conv and the rule over each group's rows, as the calls apart would."""
    proj = project(g, hdn, w, f"l{i}.lin_in")
    if step.groups is None:
        o, conv_pool, rec_pool = delta_rows(g, w, i, proj, step, conv_pool, rec_pool)
    else:  # the groups' state slots differ: each reads and writes its own rows' states
        pools = [conv_pool, rec_pool]

        def group_rows(grp, first_row, rows):
            o, pools[0], pools[1] = delta_rows(g, w, i, rows, grp, *pools)
            return o

        o = per_group(step.groups, proj, group_rows)
        conv_pool, rec_pool = pools
    return project(g, o, w, f"l{i}.lin_out"), conv_pool, rec_pool


def delta_rows(g: Graph, w: dict, i: int, proj, rows, conv_pool, rec_pool):
    """The conv, the rule and the gated norm over rows of tokens [b, t, ...] (`proj`, the
    layer's input projection), `rows` their positions, lengths and state slots (a Step or an
    AttentionGroup); returns (o [b, t, value dim], the pools with the rows' states written)."""
    la = g.cfg.linear
    b, t, _ = proj.shape
    channels, vdim, hv = la.conv_channels, la.value_dim, la.num_value_heads
    # (tensor parallel: `mixed` keeps each device's q, k and v channels together, as the conv
    # kernel and the conv states hold them)
    mixed, z, b_in, a_in = split_fused(g, proj, (channels, vdim, hv, hv))
    z = z.reshape(b, t, hv, la.value_head_dim)
    conv_state, rec_state = read_states(rows, conv_pool, rec_pool)
    live_n = rows.seq_lens - rows.positions[:, 0]  # a row's live tokens (right-aligned)
    pad = (t - live_n)[:, None]
    if t > 1:
        conv_state, mixed = align_history(conv_state, mixed, pad, la.conv_kernel)
    mixed, conv_state = la_ops.causal_conv1d(mixed, conv_state, w[f"l{i}.conv"])
    o, rec_state = delta_rule(g, w, i, mixed, b_in, a_in, pad, rec_state)
    o = la_ops.gated_rms_norm(o, z, w[f"l{i}.lin_norm"], g.cfg.rms_norm_eps).reshape(b, t, vdim)
    conv_pool, rec_pool = write_states(g, rows, conv_pool, rec_pool, conv_state, rec_state)
    return o, conv_pool, rec_pool


def read_states(step, conv_pool, rec_pool):
    """Each row's conv and recurrent states, gathered at its state slot; zero for a row starting
    at position 0, so a reused slot needs no clearing (a padding row, slot -1, reads slot 0)."""
    read = jnp.where(step.state_slots < 0, 0, step.state_slots)
    fresh = (step.positions[:, 0] == 0)[:, None, None]
    conv_state = jnp.where(fresh, 0.0, jnp.take(conv_pool, read, axis=0))
    rec_state = jnp.where(fresh[..., None], 0.0, jnp.take(rec_pool, read, axis=0))
    return conv_state, rec_state


def align_history(conv_state, mixed, pad, kernel: int):
    """CAUSAL_CONV1D's input for a row of several tokens: its history is moved to just before
    the row's first live token (padding comes first), so the conv never sees a padding input
    and the new history is the last live inputs. Returns (history, inputs) rearranged."""
    t = mixed.shape[1]
    combined = jnp.concatenate([conv_state, mixed], axis=1)  # [b, kernel - 1 + t, c]
    j = jnp.arange(t + kernel - 1)[None, :]
    idx = jnp.where(j >= pad + kernel - 1, j, jnp.clip(j - pad, 0, kernel - 2))
    arranged = jnp.take_along_axis(combined, idx[..., None], axis=1)
    return arranged[:, :kernel - 1], arranged[:, kernel - 1:]


def delta_rule(g: Graph, w: dict, i: int, mixed, b_in, a_in, pad, rec_state):
    """GATED_DELTA_RULE over the conv's output: (o [b, t, hv, dv], the recurrent state).
    Prefill runs the chunked form, decode the recurrence."""
    la = g.cfg.linear
    b, t, _ = mixed.shape
    hk, hv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    q, k, v = split_fused(g, mixed, (hk * dk, hk * dk, hv * dv))
    q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(b_in)
    # g: each token's decay, as a log
    decay = -jnp.exp(w[f"l{i}.A_log"]) * jax.nn.softplus(a_in + w[f"l{i}.dt_bias"])
    if t == 1:
        return la_ops.gated_delta_rule_recurrent(q, k, v, decay, beta, rec_state)
    # A padding token has g = 0 and beta = 0, so it leaves the state as it was.
    live = (jnp.arange(t)[None, :] >= pad)[..., None]
    decay, beta = jnp.where(live, decay, 0.0), jnp.where(live, beta, 0.0)
    return la_ops.gated_delta_rule_chunked(q, k, v, decay, beta, rec_state)


def write_states(g: Graph, step, conv_pool, rec_pool, conv_state, rec_state):
    """The rows' states scattered back at their state slots. Padding rows carry slot -1: sent
    past the pool's end, where mode="drop" skips them. One row gets a second, dropped index so
    XLA keeps a scatter in place rather than a dynamic-update-slice on a copy of the pool (as
    for the KV write)."""
    n = g.num_state_slots
    write = jnp.where(step.state_slots < 0, n, step.state_slots)
    if step.state_slots.shape[0] == 1:
        write = jnp.concatenate([write, jnp.array([n], jnp.int32)])
        conv_state = jnp.concatenate([conv_state, jnp.zeros_like(conv_state)])
        rec_state = jnp.concatenate([rec_state, jnp.zeros_like(rec_state)])
    conv_pool = conv_pool.at[write].set(conv_state.astype(conv_pool.dtype), mode="drop")
    rec_pool = rec_pool.at[write].set(rec_state.astype(rec_pool.dtype), mode="drop")
    return conv_pool, rec_pool

"""An entry of the decoder: its weight slots, its pools, its signature, and the JAX function it
lowers to StableHLO.

The graph: embed, then per layer RMSNorm, q/k/v, [q/k RMSNorm], RoPE, the KV cache write (a
scatter into the pool at each token's slot), paged attention (gather the pages the block table
names, f32 scores, softmax masked to each token's causal length), o_proj, residual, RMSNorm,
SwiGLU, residual; final norm, head, the last token's logits per row. layers.py has one
function per part; make_entry_fn strings them together.

An entry's @main takes, in this order: the step inputs (TOKEN_IDS, POSITIONS, BLOCK_TABLES,
SEQ_LENS, SLOT_MAPPING, [the windowed pool's two], [STATE_SLOTS]), the KV pools (K then V for
each attention layer, donated), [the state pools: conv then recurrent for each linear layer,
donated], and the weights in the order of `weight_slots`. A decode or prefill entry returns the
logits of each row's last token, a verify entry the argmax and the logits after every position
(speculative decoding checks each draft token against the prediction before it); then the
updated pools. Rows are right-aligned: a row's last token is at index tokens_per_seq - 1,
padding comes first with slot -1 and is never written.

A hybrid model's linear layers (qwen3_5, schema v4) read and write their states at each row's
state slot instead of KV pages (docs/design.md#linear-attention-state-slots);
linear_attention.py has the ops.

JAX is imported only to lower (make_entry_fn, lower_entry), and the graph is traced from
ShapeDtypeStructs, so no weight is held while lowering.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .config import DecoderConfig
from .gguf_packed import is_packed, layout_of
from .quant import code_dtype
from ..artifact.manifest import (BITS, BLOCK_TABLES, CHUNK, DECODE, KV_POOL_IN, KV_POOL_OUT,
                                 LORA_POOL, LORA_SLOTS, MIXED, POSITIONS, SEQ_LENS, SLOT_MAPPING,
                                 STATE_POOL_IN, STATE_POOL_OUT, STATE_SLOTS, STEP_ROLES,
                                 TOKEN_IDS, VERIFY, WEIGHT, WINDOW_BLOCK_TABLES,
                                 WINDOW_KV_POOL_IN, WINDOW_KV_POOL_OUT, WINDOW_SLOT_MAPPING,
                                 KvPool, Program, StatePool, TensorSpec, WindowedKv,
                                 leading_outputs)
from ..artifact.sharding import TensorParallel, mesh_sharding
from ..lora.layout import LoraLayout


@dataclass(frozen=True)
class WeightSlot:
    """A weight as the artifact stores it: q|k|v and gate|up fused; a linear is [in, out] in an
    f32 artifact and [out, in] (the checkpoint's own layout) in a bf16 one (`out_first`)."""

    name: str
    shape: tuple[int, ...]
    # "linear" | "norm" | "embed" | "param" (f32: conv kernel, decay, a router) | "scale" |
    # "experts" (a mixture's stacked [experts, out, in])
    kind: str
    out_first: bool = False
    # "int8" | "fp8": codes [out, in], then a "<name>.scale" slot; a packed type ("Q4_1",
    # "INT4_G32", "B6_G16_Z32_O"): the packed codes, then the layout's other arrays
    # ("<name>.high", ".scale", ".offset"; gguf_packed.Layout), each slot carrying the type
    quant: str | None = None
    stored: str | None = None  # a packed weight's arrays: their element type

    def dtype(self, weight_dtype: str) -> str:
        """Norm weights stay f32 (they are tiny and the norms compute in f32), and so do a
        quantized linear's scales; linears and the embedding table take the export's weight
        dtype, a quantized linear its codes' type."""
        if self.stored is not None:
            return self.stored
        if self.quant is not None:
            return code_dtype(self.quant)
        return weight_dtype if self.kind in ("linear", "embed", "experts") else "f32"


def out_first_linears(weight_dtype: str) -> bool:
    """Whether an artifact's linears are stored [out, in].

    XLA's CPU backend turns a one-row dot into a fused multiply-reduce, and only fuses a widening
    convert into it when the reduced axis is the weight's minor one: a bf16 [out, in] weight is
    read once as bf16 (SmolLM2's layers at one row: 15 ms, against 190 ms for bf16 [in, out] and
    27 ms for f32 [in, out]). An f32 artifact keeps [in, out]: its several-row decode and its
    prefill run as GEMMs, which Eigen does 1.75x faster on [in, out] at 64 rows
    (docs/performance.md)."""
    return weight_dtype != "f32"


def loops_layers(cfg: DecoderConfig, windowed: WindowedKv | None) -> bool:
    """Whether the model's layers can run as one loop over stacked weights: every layer an
    attention layer with the same window and RoPE and the same MLP (dense, or experts), none on
    a ring (a pattern of layer kinds, as gemma3's and qwen3_5's, is unrolled)."""
    n = cfg.num_layers
    return (windowed is None and cfg.linear is None and n > 1
            and len({cfg.window(i) for i in range(n)}) == 1
            and len({cfg.is_sparse(i) for i in range(n)}) == 1
            and all(np.array_equal(cfg.inv_freq(i), cfg.inv_freq(0)) for i in range(n)))


def packed_slots(name: str, quant: str, n_in: int, n_out: int) -> list[WeightSlot]:
    """A packed weight: one slot per array of its type's layout, [out, ...]."""
    return [WeightSlot(name + suffix, shape, "linear" if not suffix else "scale", True, quant,
                       dtype) for suffix, dtype, shape in layout_of(quant).parts(n_out, n_in)]


def quant_of(weight_quant, name: str) -> str | None:
    """A linear's quantization: the export's (`weight_quant` a name), or by slot name (a
    mapping: a packed --weight-quant, each linear its packed type, "l0.qkv" standing for every
    layer of a loop; a slot not named keeps the weight dtype)."""
    if isinstance(weight_quant, Mapping):
        return weight_quant.get(name)
    return weight_quant


def weight_slots(cfg: DecoderConfig, weight_dtype: str = "f32",
                 weight_quant: str | Mapping | None = None, quant_head: bool = False,
                 layer_loop: bool = False, in_out_copy: bool = False) -> list[WeightSlot]:
    """The artifact's weights in @main's order. With `quant_head` (and a weight_quant) the head
    is quantized too: a tied table as codes [vocab, hidden] and a scale per vocab row, which
    the head reads as its [out, in] and the embedding gathers and scales; an untied lm_head
    like the layers' linears. With `layer_loop` each layer weight is one slot stacked over the
    layers ("layers.qkv" [layers, out, in]), its linears [out, in] whatever the dtype
    (`stacked_slots`). With `in_out_copy` too (a layer loop's f32 linears), each stacked
    linear that is not quantized has an [in, out] copy of each layer after the stacks
    ("l3.qkv.in_out" [in, out]), which products of more than layers.IN_OUT_ROWS rows read
    (`in_out_copies`)."""
    h = cfg.hidden_size
    of = out_first_linears(weight_dtype)

    def linear(name, n_in, n_out, quantized=True, out_first=of):
        """A layer's linear; with --weight-quant its codes, stored [out, in] whatever the
        weight dtype (one-row products widen codes as they read them only along the weight's
        minor axis), and its scale per output channel."""
        quant = quant_of(weight_quant, name)
        if is_packed(quant):
            return packed_slots(name, quant, n_in, n_out)
        if quant is not None and quantized:
            return [WeightSlot(name, (n_out, n_in), "linear", True, quant),
                    WeightSlot(f"{name}.scale", (n_out,), "scale")]
        return [WeightSlot(name, (n_out, n_in) if out_first else (n_in, n_out), "linear",
                           out_first)]

    def experts(name, n_experts, n_out, n_in):
        """A mixture's stacked experts, quantized like the linears (int8 or fp8)."""
        return expert_slots(name, n_experts, n_out, n_in, quant_of(weight_quant, name))

    # A tied f32 table is stored once, [hidden, vocab]: the head's [in, out] layout (XLA's CPU
    # dot against a [vocab, hidden] table contracting [1] x [1] took 62.6 ms at 4 rows against
    # 6.4 ms for this layout); the embedding gathers its columns. A tied table in an
    # [out, in] artifact is [vocab, hidden], which is already the head's [out, in]. An untied
    # table stays [vocab, hidden] (row gathers) beside its own lm_head. The table is quantized
    # only when a packed --weight-quant names a type for it, or with quant_head: int8 and fp8
    # (a name, not a mapping) are the linears', and without quant_head the table keeps the
    # weight dtype and its layout.
    table_quant = quant_of(weight_quant, "embed")
    packed_table = is_packed(table_quant)
    transposed = cfg.tie_word_embeddings and not of and not quant_head and not packed_table
    if packed_table:  # gathered row by row, and a tied head's [out, in]
        slots = packed_slots("embed", table_quant, h, cfg.vocab_size)
    elif quant_head and cfg.tie_word_embeddings:
        slots = [WeightSlot("embed", (cfg.vocab_size, h), "embed", True, weight_quant),
                 WeightSlot("embed.scale", (cfg.vocab_size,), "scale")]
    else:
        slots = [WeightSlot("embed_t", (h, cfg.vocab_size), "embed") if transposed
                 else WeightSlot("embed", (cfg.vocab_size, h), "embed", of)]
    if layer_loop:
        first = layer_slots(cfg, 0, lambda *a: linear(*a, out_first=True), experts)
        slots += stacked_slots(first, cfg.num_layers)
        if in_out_copy:
            slots += in_out_copies(slots)
    else:
        for i in range(cfg.num_layers):
            slots += layer_slots(cfg, i, linear, experts)
    slots.append(WeightSlot("final_norm", (h,), "norm"))
    if not cfg.tie_word_embeddings:
        # the head keeps the weight dtype unless quant_head
        slots += linear("lm_head", h, cfg.vocab_size, quantized=quant_head)
    return slots


def layer_slots(cfg: DecoderConfig, i: int, linear, experts=None) -> list[WeightSlot]:
    """Layer i's weight slots ("l{i}.<part>"); `linear(name, n_in, n_out)` gives a linear's,
    `experts(name, experts, n_out, n_in)` a mixture's stacked experts'."""
    h, d = cfg.hidden_size, cfg.head_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    if cfg.attn_output_gate:  # q_proj gives each head's query and its output gate
        qkv += cfg.num_heads * d
    la = cfg.linear
    slots = [WeightSlot(f"l{i}.attn_norm", (h,), "norm")]
    if cfg.is_linear(i):
        # A Gated DeltaNet layer: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a fused, the
        # conv kernel [channels, kernel], A_log and dt_bias per value head, the gated norm
        # (its weight as stored: no 1 + weight), out_proj.
        hv = la.num_value_heads
        slots += [*linear(f"l{i}.lin_in", h, la.conv_channels + la.value_dim + 2 * hv),
                  WeightSlot(f"l{i}.conv", (la.conv_channels, la.conv_kernel), "param"),
                  WeightSlot(f"l{i}.A_log", (hv,), "param"),
                  WeightSlot(f"l{i}.dt_bias", (hv,), "param"),
                  WeightSlot(f"l{i}.lin_norm", (la.value_head_dim,), "param"),
                  *linear(f"l{i}.lin_out", la.value_dim, h)]
    else:
        slots += linear(f"l{i}.qkv", h, qkv)
        if cfg.qk_norm:
            slots += [WeightSlot(f"l{i}.q_norm", (d,), "norm"),
                      WeightSlot(f"l{i}.k_norm", (d,), "norm")]
        slots += linear(f"l{i}.o", cfg.num_heads * d, h)
    if cfg.sandwich_norms:
        slots.append(WeightSlot(f"l{i}.post_attn_norm", (h,), "norm"))
    slots.append(WeightSlot(f"l{i}.mlp_norm", (h,), "norm"))
    if cfg.is_sparse(i):  # the router (f32), then every expert's gate|up and down, [out, in]
        m = cfg.moe
        slots.append(WeightSlot(f"l{i}.router", (m.num_experts, h), "param"))
        for part, n_out, n_in in (("experts_gate_up", 2 * m.intermediate_size, h),
                                  ("experts_down", h, m.intermediate_size)):
            slots += experts(f"l{i}.{part}", m.num_experts, n_out, n_in)
        if m.shared_intermediate_size:  # a gated MLP beside them, and its sigmoid gate
            slots += [*linear(f"l{i}.shared_gate_up", h, 2 * m.shared_intermediate_size),
                      *linear(f"l{i}.shared_down", m.shared_intermediate_size, h),
                      WeightSlot(f"l{i}.shared_gate", (1, h), "param")]
    else:
        slots += [*linear(f"l{i}.gate_up", h, 2 * cfg.intermediate_size),
                  *linear(f"l{i}.down", cfg.intermediate_size, h)]
    if cfg.sandwich_norms:
        slots.append(WeightSlot(f"l{i}.post_mlp_norm", (h,), "norm"))
    return slots


def expert_slots(name: str, experts: int, n_out: int, n_in: int,
                 quant: str | None) -> list[WeightSlot]:
    """A mixture's stacked experts [experts, out, in]; int8 or fp8: their codes, then a scale
    per expert and output channel [experts, out]; a packed type: each expert's packed arrays
    stacked, [experts, ...] each (packed_slots')."""
    if quant is None:
        return [WeightSlot(name, (experts, n_out, n_in), "experts", True)]
    if is_packed(quant):
        return [WeightSlot(s.name, (experts, *s.shape), "experts" if s.kind == "linear"
                           else "scale", True, quant, s.stored)
                for s in packed_slots(name, quant, n_in, n_out)]
    return [WeightSlot(name, (experts, n_out, n_in), "experts", True, quant),
            WeightSlot(f"{name}.scale", (experts, n_out), "scale")]


STACKED = "layers."  # the prefix of a slot stacked over the layers
IN_OUT = ".in_out"  # the suffix of a layer's [in, out] copy of a linear (in_out_copies)


def slot_part(name: str) -> str:
    """A layer slot's part ("qkv.scale" of "l3.qkv.scale" or "layers.qkv.scale"); any other
    slot's own name ("embed", "lm_head.scale")."""
    first, _, rest = name.partition(".")
    layer = first == STACKED[:-1] or (first[:1] == "l" and first[1:].isdigit())
    return rest if layer else name


def slot_layer(name: str) -> int:
    """An unrolled layer slot's layer (3 of "l3.qkv")."""
    first = name.partition(".")[0]
    assert first[:1] == "l" and first[1:].isdigit(), name
    return int(first[1:])


def stacked_slots(first: list[WeightSlot], num_layers: int) -> list[WeightSlot]:
    """Layer 0's slots as slots stacked over every layer: "l0.qkv" [out, in] becomes
    "layers.qkv" [layers, out, in]."""
    return [WeightSlot(STACKED + s.name.split(".", 1)[1], (num_layers, *s.shape), s.kind,
                       s.out_first, s.quant, s.stored) for s in first]


def in_out_copies(slots: list[WeightSlot]) -> list[WeightSlot]:
    """The [in, out] copies of the stacked f32 linears among `slots`, one slot per layer
    ("l3.qkv.in_out" [in, out]), layer by layer.

    The layer loop stores its linears [out, in]: a product per row along the weight's minor
    axis reads the layer's slice of the stack in place, the fastest form for one row. Each
    extra row reads the weight again, and one product of all rows on a slice first copies the
    slice out of the stack (XLA's CPU backend); a product of more than layers.IN_OUT_ROWS rows
    runs on the layer's own [in, out] buffer instead, picked by the loop's layer
    (layers.LayerWeights;
    docs/performance.md#a-buffer-per-layer-and-a-smaller-key-block-for-many-rows)."""
    linears = [s for s in slots if s.name.startswith(STACKED) and s.kind == "linear"
               and s.quant is None and s.stored is None and len(s.shape) == 3]
    layers = linears[0].shape[0] if linears else 0
    return [WeightSlot(f"l{i}.{s.name[len(STACKED):]}{IN_OUT}", (s.shape[2], s.shape[1]),
                       "linear") for i in range(layers) for s in linears]


def unstacked_slot(slot: WeightSlot, i: int) -> WeightSlot:
    """Layer i's part of a stacked slot, as the unrolled layout names it."""
    assert slot.name.startswith(STACKED), slot.name
    return WeightSlot(f"l{i}.{slot.name[len(STACKED):]}", slot.shape[1:], slot.kind,
                      slot.out_first, slot.quant, slot.stored)


def kv_pools(cfg: DecoderConfig, num_blocks: int, block_size: int, kv_dtype: str,
             windowed: WindowedKv | None = None, layer_loop: bool = False) -> list[KvPool]:
    """K then V for each attention layer; a windowed layer's pools hold rings (schema v3). With
    `layer_loop`, one K and one V pool hold every layer, [pages, layers, block, heads, d]: a
    page keeps its first axis, so a page of every layer is one row to move."""
    if layer_loop:
        shape = (num_blocks, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_size)
        return [KvPool(f"{STACKED}{kind}", 0, kind, kv_dtype, shape, "full", cfg.num_layers)
                for kind in ("k", "v")]
    pools = []
    for i in cfg.attention_layers:
        ring = windowed is not None and i in windowed.layers
        pages = windowed.num_blocks if ring else num_blocks
        for kind in ("k", "v"):
            pools.append(KvPool(f"l{i}.{kind}", i, kind, kv_dtype,
                                (pages, block_size, cfg.num_kv_heads, cfg.head_size),
                                "windowed" if ring else "full"))
    return pools


def state_pools(cfg: DecoderConfig, num_slots: int) -> list[StatePool]:
    """Conv then recurrent states for each linear layer, f32, one per state slot (schema v4)."""
    la = cfg.linear
    if la is None:
        return []
    pools = []
    for i in la.layers:
        pools += [StatePool(f"l{i}.conv", i, "conv", "f32",
                            (num_slots, la.conv_kernel - 1, la.conv_channels)),
                  StatePool(f"l{i}.recurrent", i, "recurrent", "f32",
                            (num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim))]
    return pools


def step_specs(kind: str, batch: int, tokens: int, pages: int, windowed: bool, linear: bool,
               lora: bool) -> list[TensorSpec]:
    """An entry's step inputs, in @main's order (the one order entry_program writes and
    make_entry_fn reads): the rows' token ids, positions, block tables, lengths and slots; a
    mixed entry's chunk's own after its decode rows' (its `batch` rows take one token each and
    its chunk `tokens`, right-aligned as a prefill row); with a windowed pool the window
    tables and ring slots (a mixed entry's decode rows', then its chunk's); with state pools
    each row's state slot (then the chunk's); with adapters each row's adapter slot (a mixed
    entry's decode rows' and then its chunk's, [batch + 1])."""
    mixed = kind == MIXED
    b, t = batch, 1 if mixed else tokens  # a mixed entry's decode rows take one token

    def rows(n: int, width: int) -> list[tuple[str, tuple]]:
        return [(TOKEN_IDS, (n, width)), (POSITIONS, (n, width)), (BLOCK_TABLES, (n, pages)),
                (SEQ_LENS, (n,)), (SLOT_MAPPING, (n, width))]

    def windows(n: int, width: int) -> list[tuple[str, tuple]]:
        return [(WINDOW_BLOCK_TABLES, (n, pages)), (WINDOW_SLOT_MAPPING, (n, width))]

    def chunk(roles: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
        return [(CHUNK + role, shape) for role, shape in roles] if mixed else []

    roles = rows(b, t) + chunk(rows(1, tokens))
    if windowed:
        roles += windows(b, t) + chunk(windows(1, tokens))
    if linear:
        roles += [(STATE_SLOTS, (b,))] + chunk([(STATE_SLOTS, (1,))])
    if lora:
        roles.append((LORA_SLOTS, (b + 1,) if mixed else (b,)))
    # (each input is named as its role, in lower case)
    return [TensorSpec(role.lower(), role, "i32", shape) for role, shape in roles]


def entry_program(cfg: DecoderConfig, name: str, batch: int, context: int, tokens_per_seq: int,
                  block_size: int, num_blocks: int, weight_dtype: str,
                  kv_dtype: str, windowed: WindowedKv | None = None,
                  num_state_slots: int = 0, weight_quant: str | None = None,
                  quant_head: bool = False, layer_loop: bool = False,
                  kind: str = DECODE, lora: LoraLayout | None = None,
                  in_out_copy: bool = False) -> Program:
    """The signature of one entry, in @main's order; the outputs before the pools are the
    kind's (manifest.leading_outputs): one for decode, prefill and mixed, two for verify. With
    `lora`, each row's adapter slot and the adapter pools (read, never donated). A mixed
    entry takes `batch` decode rows' step inputs, then its chunk's (`tokens_per_seq` tokens);
    its adapter slots are the decode rows' and then the chunk's, [batch + 1]."""
    inputs = step_specs(kind, batch, tokens_per_seq, context // block_size, windowed is not None,
                        cfg.linear is not None, lora is not None)
    pools = kv_pools(cfg, num_blocks, block_size, kv_dtype, windowed, layer_loop)
    states = state_pools(cfg, num_state_slots)
    pool_start = len(inputs)

    def role_of(p, windowed_role, kv_role, state_role):
        if isinstance(p, StatePool):
            return state_role
        return windowed_role if p.pool_class == "windowed" else kv_role

    # Pools and stacked weights of bf16 or f8 values are taken as their bits (manifest.BITS):
    # an f8 pool is gathered and scattered as bytes, a stacked weight sliced a layer at a time.
    for p in (*pools, *states):
        inputs.append(TensorSpec(f"{p.name}.in", role_of(p, WINDOW_KV_POOL_IN, KV_POOL_IN,
                                                          STATE_POOL_IN),
                                 BITS.get(p.dtype, p.dtype), p.shape, pool=p.name))
    for name, shape in (lora.program_shapes().items() if lora is not None else ()):
        inputs.append(TensorSpec(name, LORA_POOL, "f32", shape, pool=name))
    for s in weight_slots(cfg, weight_dtype, weight_quant, quant_head, layer_loop, in_out_copy):
        dtype = s.dtype(weight_dtype)
        if s.name.startswith(STACKED):
            dtype = BITS.get(dtype, dtype)
        inputs.append(TensorSpec(f"w.{s.name}", WEIGHT, dtype, s.shape, slot=s.name))
    outputs = list(leading_outputs(kind, batch, tokens_per_seq, cfg.vocab_size, cfg.moe and (
        len(cfg.moe.layers), cfg.moe.num_experts)))
    first_pool = len(outputs)
    for p in (*pools, *states):
        outputs.append(TensorSpec(f"{p.name}.out", role_of(p, WINDOW_KV_POOL_OUT, KV_POOL_OUT,
                                                            STATE_POOL_OUT),
                                  BITS.get(p.dtype, p.dtype), p.shape, pool=p.name))
    donation = tuple((first_pool + i, pool_start + i) for i in range(len(pools) + len(states)))
    return Program(name, tuple(inputs), tuple(outputs), donation)


def layer_pools(cfg: DecoderConfig) -> dict[int, tuple[int, int]]:
    """Each layer's two pools as indices into @main's pools: K and V of the attention layers,
    then conv and recurrent states of the linear layers."""
    attn = cfg.attention_layers
    pool_of = {layer: (2 * n, 2 * n + 1) for n, layer in enumerate(attn)}
    for n, layer in enumerate(cfg.linear.layers if cfg.linear is not None else ()):
        pool_of[layer] = (2 * len(attn) + 2 * n, 2 * len(attn) + 2 * n + 1)
    return pool_of


def make_entry_fn(cfg: DecoderConfig, block_size: int, num_blocks: int, weight_dtype: str,
                  key_blocks: tuple[int, ...] = (2048,), windowed: WindowedKv | None = None,
                  num_state_slots: int = 0, weight_quant: str | None = None,
                  quant_head: bool = False, layer_loop: bool = False, kind: str = DECODE,
                  shards: int = 1, packed_shards: dict | None = None,
                  lora: LoraLayout | None = None, batch: int = 0, in_out_copy: bool = False):
    """The function an entry lowers: f(step inputs..., pools..., weights...) -> (logits,
    pools...), for a verify entry (argmax [b, t], logits [b, t, vocab], pools...).
    layers.py has its parts. With `layer_loop` the layers run as a loop (`lax.scan`) over the
    stacked weights and pools, so the program holds one layer's kernels instead of one set per
    layer (docs/design.md#the-layer-loop). `key_blocks`: this entry's key blocks, ascending (a
    larger context attends block by block; ExportOptions.key_blocks). `shards`: the devices of a
    tensor-parallel program, whose fused weights hold each device's part of every fused part
    (layers.split_fused), and `packed_shards` how its packed weights are divided
    (layers.Graph.packed_shards). A mixed entry's function runs its `batch` decode rows and
    its chunk as one row of every token (layers.make_mixed_step)."""
    import jax.numpy as jnp

    from . import layers

    slots = weight_slots(cfg, weight_dtype, weight_quant, quant_head, layer_loop, in_out_copy)
    names = [s.name for s in slots]
    # The parts look slots up by their unrolled names ("l0.qkv"): a stacked slot's layer 0.
    layer0 = [unstacked_slot(s, 0) for s in slots if s.name.startswith(STACKED)]
    slot_of = {s.name: s for s in (*slots, *layer0)}
    g = layers.Graph(cfg, slot_of, weight_dtype == "bf16", block_size, num_blocks,
                     tuple(key_blocks), windowed, num_state_slots, shards, packed_shards or {},
                     lora.graph_pieces() if lora is not None else {})
    pool_of = layer_pools(cfg)
    roles = [spec.role for spec in step_specs(kind, batch, 1, 1, windowed is not None,
                                              cfg.linear is not None, lora is not None)]
    n_step = len(roles)
    n_pools = 2 if layer_loop else 2 * cfg.num_layers
    lora_pools = list(lora.pool_shapes()) if lora is not None else []
    n_decode = batch  # a mixed entry's decode rows

    def outputs(x, w):
        if kind == MIXED:  # the decode rows' tokens, then the chunk's last
            return (layers.head(g, w, layers.mixed_last_tokens(x, n_decode)),)
        if kind != VERIFY:
            return (layers.head(g, w, x),)
        logits = layers.head_all_positions(g, w, x)
        return layers.argmax_ids(logits), logits

    def fn(*args):
        given = dict(zip(roles, args[:n_step]))
        plain = [given[r] for r in STEP_ROLES]
        pools = list(args[n_step:n_step + n_pools])  # an fp8 pool as its bytes
        adapters = dict(zip(lora_pools, args[n_step + n_pools:]))
        w = dict(zip(names, args[n_step + n_pools + len(lora_pools):]))
        if kind == MIXED:  # one row of every token: the decode rows', then the chunk's
            chunk = [given[CHUNK + r] for r in STEP_ROLES]
            rings = None
            if windowed is not None:  # the decode rows' window inputs, then the chunk's
                rings = tuple((given[p + WINDOW_BLOCK_TABLES], given[p + WINDOW_SLOT_MAPPING])
                              for p in ("", CHUNK))
            states = ((given[STATE_SLOTS], given[CHUNK + STATE_SLOTS])
                      if cfg.linear is not None else None)
            x = layers.embed(g, w, layers.flat_tokens(plain[0], chunk[0]))
            step = layers.make_mixed_step(g, plain, chunk, rings, states)
        else:
            # The embedding, then the step's scatter indices: the order of the lowered text.
            x = layers.embed(g, w, plain[0])
            step = layers.make_step(g, *plain, given.get(WINDOW_BLOCK_TABLES),
                                    given.get(WINDOW_SLOT_MAPPING), given.get(STATE_SLOTS))
        if lora is not None:  # each part's (A, B) pools, read whole by every layer
            step.lora_slots = given[LORA_SLOTS]
            step.lora_pools = {p.part: (adapters[lora.pool_name(p.part, "a")],
                                        adapters[lora.pool_name(p.part, "b")])
                               for p in lora.parts}
        if layer_loop:
            x, new_pools = layers.layer_loop(g, step, w, x, *pools)
        else:
            new_pools = list(pools)
            for i in range(cfg.num_layers):
                a, b = pool_of[i]
                x, new_pools[a], new_pools[b] = layers.decoder_layer(g, step, w, i, x, pools[a],
                                                                     pools[b])
        if cfg.moe is not None:  # the call's expert load, [sparse layers, experts]
            assert len(step.expert_loads) == len(cfg.moe.layers), len(step.expert_loads)
            return (*outputs(x, w), jnp.stack(step.expert_loads), *new_pools)
        return (*outputs(x, w), *new_pools)

    return fn


def lower_entry(cfg: DecoderConfig, program: Program, block_size: int, num_blocks: int,
                weight_dtype: str, key_blocks: tuple[int, ...] = (2048,),
                windowed: WindowedKv | None = None, num_state_slots: int = 0,
                weight_quant: str | None = None, quant_head: bool = False,
                layer_loop: bool = False, kind: str = DECODE,
                tp: TensorParallel | None = None, lora: LoraLayout | None = None,
                in_out_copy: bool = False) -> str:
    """StableHLO text of one entry; every pool parameter is donated (tf.aliasing_output). With
    `tp`, a program for its devices: each weight and pool annotated with its split (Shardy
    shardings over a one-axis mesh), the step inputs and the logits replicated; XLA's SPMD
    partitioner divides the work when the runtime compiles it for the devices."""
    import jax

    from ..artifact.manifest import numpy_dtype

    shards = tp.devices if tp is not None else 1
    fn = make_entry_fn(cfg, block_size, num_blocks, weight_dtype, key_blocks, windowed,
                       num_state_slots, weight_quant, quant_head, layer_loop, kind, shards,
                       packed_shards(tp, weight_slots(cfg, weight_dtype, weight_quant,
                                                      quant_head, layer_loop)), lora,
                       program.inputs[0].shape[0], in_out_copy)
    specs = [jax.ShapeDtypeStruct(s.shape, numpy_dtype(s.dtype)) for s in program.inputs]
    donate = tuple(i for _, i in program.donation)
    if tp is None:
        lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True).lower(*specs)
        return lowered.as_text()
    ins = tuple(partition(tp, s, lora) for s in program.inputs)
    outs = tuple(partition(tp, s) for s in program.outputs)
    # An abstract mesh: the exporting process needs no devices of its own.
    jitted = jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=donate,
                     keep_unused=True)
    return jitted.trace(*specs).lower(lowering_platforms=(jax.default_backend(),)).as_text()


def packed_shards(tp: TensorParallel | None, slots: list[WeightSlot]) -> dict:
    """By part ("qkv", "down", "embed"): how each split packed weight is divided over the
    devices, for layers.Graph: along its rows, banded piece by piece
    (tensor_parallel.packed_row_split), or along its inputs."""
    from .packed_linear import PackedShards
    from .tensor_parallel import packed_row_split

    out = {}
    for s in slots:
        split = tp.weights.get(s.name) if tp is not None else None
        if not is_packed(s.quant) or s.kind != "linear" or split is None:
            continue
        part = slot_part(s.name)
        rows = packed_row_split(tp, s)
        out[part] = (PackedShards(tp.devices, rows.device_pieces(tp.devices)) if rows
                     else PackedShards(tp.devices, by_inputs=True))
    return out


def partition(tp: TensorParallel, spec: TensorSpec, lora: LoraLayout | None = None):
    """A program input's or output's sharding: along its split axis, or replicated."""
    if spec.role == LORA_POOL:
        split = lora.pool_splits().get(spec.pool)
        return mesh_sharding(tp.devices, len(spec.shape), split.axis if split else None)
    axis = (tp.partition_axis(spec.slot) if spec.slot is not None
            else tp.partition_axis(spec.pool, pool=True) if spec.pool is not None else None)
    return mesh_sharding(tp.devices, len(spec.shape), axis)


__all__ = ["WeightSlot", "IN_OUT", "in_out_copies", "out_first_linears", "loops_layers",
           "weight_slots", "layer_slots", "stacked_slots", "unstacked_slot", "STACKED", "kv_pools", "state_pools",
           "entry_program", "layer_pools", "make_entry_fn", "lower_entry", "packed_shards",
           "partition", "slot_part"]

"""The decoder graph of one entry, written in JAX and lowered to StableHLO by the exporter.

Design section 1: embed, then per layer RMSNorm, q/k/v, [q/k RMSNorm], RoPE, the KV cache write
(a scatter into the pool at each token's slot), paged attention (gather the pages the block
table names, f32 scores, softmax masked to each token's causal length), o_proj, residual,
RMSNorm, SwiGLU, residual; final norm, head, the last token's logits per row.

An entry's @main takes, in this order: the step inputs (TOKEN_IDS, POSITIONS, BLOCK_TABLES,
SEQ_LENS, SLOT_MAPPING, [the windowed pool's two], [STATE_SLOTS]), the KV pools (K then V for
each attention layer, donated), [the state pools: conv then recurrent for each linear layer,
donated], and the weights in the order of `weight_slots`. It returns the logits of each row's
last token and the updated pools. Rows are right-aligned: a row's last token is at index
tokens_per_seq - 1, padding comes first with slot -1 and is never written.

A hybrid model's linear layers (qwen3_5, schema v4) read and write their states at each row's
state slot instead of KV pages (design section 3, "Linear-attention layers"):
linear_attention.py has the ops.

Only this module and export.py import JAX at export time; the graph is traced from
ShapeDtypeStructs, so no weight is held while lowering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checkpoint import DecoderConfig
from .quant import code_dtype
from ..manifest import (BLOCK_TABLES, KV_POOL_IN, KV_POOL_OUT, LOGITS, POSITIONS, SEQ_LENS,
                       SLOT_MAPPING, STATE_POOL_IN, STATE_POOL_OUT, STATE_SLOTS, TOKEN_IDS,
                       WEIGHT, WINDOW_BLOCK_TABLES, WINDOW_KV_POOL_IN, WINDOW_KV_POOL_OUT,
                       WINDOW_SLOT_MAPPING, KvPool, Program, StatePool, TensorSpec, WindowedKv)


@dataclass(frozen=True)
class WeightSlot:
    """A weight as the artifact stores it: q|k|v and gate|up fused; a linear is [in, out] in an
    f32 artifact and [out, in] (the checkpoint's own layout) in a bf16 one (`out_first`)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" | "norm" | "embed" | "param" (f32: conv kernel, decay) | "scale"
    out_first: bool = False
    quant: str | None = None  # "int8" | "fp8": codes [out, in], then a "<name>.scale" slot

    def dtype(self, weight_dtype: str) -> str:
        """Norm weights stay f32 (they are tiny and the norms compute in f32), and so do a
        quantized linear's scales; linears and the embedding table take the export's weight
        dtype, a quantized linear its codes' type."""
        if self.quant is not None:
            return code_dtype(self.quant)
        return weight_dtype if self.kind in ("linear", "embed") else "f32"


def out_first_linears(weight_dtype: str) -> bool:
    """Whether an artifact's linears are stored [out, in].

    XLA's CPU backend turns a one-row dot into a fused multiply-reduce, and only fuses a widening
    convert into it when the reduced axis is the weight's minor one: a bf16 [out, in] weight is
    read once as bf16 (SmolLM2's layers at one row: 15 ms, against 190 ms for bf16 [in, out] and
    27 ms for f32 [in, out]). An f32 artifact keeps [in, out]: its several-row decode and its
    prefill run as GEMMs, which Eigen does 1.75x faster on [in, out] at 64 rows (FACTS.md,
    docs/performance.md)."""
    return weight_dtype != "f32"


def weight_slots(cfg: DecoderConfig, weight_dtype: str = "f32",
                 weight_quant: str | None = None, quant_head: bool = False) -> list[WeightSlot]:
    """The artifact's weights in @main's order. With `quant_head` (and a weight_quant) the head
    is quantized too: a tied table as codes [vocab, hidden] and a scale per vocab row, which
    the head reads as its [out, in] and the embedding gathers and scales; an untied lm_head
    like the layers' linears."""
    h, d = cfg.hidden_size, cfg.head_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    of = out_first_linears(weight_dtype)

    def linear(name, n_in, n_out, quantized=True):
        """A layer's linear; with --weight-quant its codes, stored [out, in] whatever the
        weight dtype (one-row products widen codes as they read them only along the weight's
        minor axis), and its scale per output channel."""
        if weight_quant is not None and quantized:
            return [WeightSlot(name, (n_out, n_in), "linear", True, weight_quant),
                    WeightSlot(f"{name}.scale", (n_out,), "scale")]
        return [WeightSlot(name, (n_out, n_in) if of else (n_in, n_out), "linear", of)]

    # A tied f32 table is stored once, [hidden, vocab]: the head's [in, out] layout (XLA's CPU
    # dot against a [vocab, hidden] table contracting [1] x [1] took 62.6 ms at 4 rows against
    # 6.4 ms for this layout, FACTS.md); the embedding gathers its columns. A tied table in an
    # [out, in] artifact is [vocab, hidden], which is already the head's [out, in]. An untied
    # table stays [vocab, hidden] (row gathers) beside its own lm_head.
    transposed = cfg.tie_word_embeddings and not of and not quant_head
    if quant_head and cfg.tie_word_embeddings:
        slots = [WeightSlot("embed", (cfg.vocab_size, h), "embed", True, weight_quant),
                 WeightSlot("embed.scale", (cfg.vocab_size,), "scale")]
    else:
        slots = [WeightSlot("embed_t", (h, cfg.vocab_size), "embed") if transposed
                 else WeightSlot("embed", (cfg.vocab_size, h), "embed", of)]
    if cfg.attn_output_gate:  # q_proj gives each head's query and its output gate
        qkv += cfg.num_heads * d
    la = cfg.linear
    for i in range(cfg.num_layers):
        slots.append(WeightSlot(f"l{i}.attn_norm", (h,), "norm"))
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
        slots += [
            WeightSlot(f"l{i}.mlp_norm", (h,), "norm"),
            *linear(f"l{i}.gate_up", h, 2 * cfg.intermediate_size),
            *linear(f"l{i}.down", cfg.intermediate_size, h),
        ]
        if cfg.sandwich_norms:
            slots.append(WeightSlot(f"l{i}.post_mlp_norm", (h,), "norm"))
    slots.append(WeightSlot("final_norm", (h,), "norm"))
    if not cfg.tie_word_embeddings:
        # the head keeps the weight dtype unless quant_head
        slots += linear("lm_head", h, cfg.vocab_size, quantized=quant_head)
    return slots


def kv_pools(cfg: DecoderConfig, num_blocks: int, block_size: int, kv_dtype: str,
             windowed: WindowedKv | None = None) -> list[KvPool]:
    """K then V for each attention layer; a windowed layer's pools hold rings (schema v3)."""
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


def entry_program(cfg: DecoderConfig, name: str, batch: int, context: int, tokens_per_seq: int,
                  block_size: int, num_blocks: int, weight_dtype: str,
                  kv_dtype: str, windowed: WindowedKv | None = None,
                  num_state_slots: int = 0, weight_quant: str | None = None,
                  quant_head: bool = False) -> Program:
    """The signature of one entry, in @main's order."""
    b, t, m = batch, tokens_per_seq, context // block_size
    inputs = [
        TensorSpec("token_ids", TOKEN_IDS, "i32", (b, t)),
        TensorSpec("positions", POSITIONS, "i32", (b, t)),
        TensorSpec("block_tables", BLOCK_TABLES, "i32", (b, m)),
        TensorSpec("seq_lens", SEQ_LENS, "i32", (b,)),
        TensorSpec("slot_mapping", SLOT_MAPPING, "i32", (b, t)),
    ]
    if windowed is not None:
        inputs += [TensorSpec("window_block_tables", WINDOW_BLOCK_TABLES, "i32", (b, m)),
                   TensorSpec("window_slot_mapping", WINDOW_SLOT_MAPPING, "i32", (b, t))]
    if cfg.linear is not None:
        inputs.append(TensorSpec("state_slots", STATE_SLOTS, "i32", (b,)))
    pools = kv_pools(cfg, num_blocks, block_size, kv_dtype, windowed)
    states = state_pools(cfg, num_state_slots)
    pool_start = len(inputs)

    def role_of(p, windowed_role, kv_role, state_role):
        if isinstance(p, StatePool):
            return state_role
        return windowed_role if p.pool_class == "windowed" else kv_role

    for p in (*pools, *states):
        inputs.append(TensorSpec(f"{p.name}.in", role_of(p, WINDOW_KV_POOL_IN, KV_POOL_IN,
                                                          STATE_POOL_IN),
                                 p.dtype, p.shape, pool=p.name))
    for s in weight_slots(cfg, weight_dtype, weight_quant, quant_head):
        inputs.append(TensorSpec(f"w.{s.name}", WEIGHT, s.dtype(weight_dtype), s.shape, slot=s.name))
    outputs = [TensorSpec("logits", LOGITS, "f32", (b, cfg.vocab_size))]
    for p in (*pools, *states):
        outputs.append(TensorSpec(f"{p.name}.out", role_of(p, WINDOW_KV_POOL_OUT, KV_POOL_OUT,
                                                            STATE_POOL_OUT),
                                  p.dtype, p.shape, pool=p.name))
    donation = tuple((1 + i, pool_start + i) for i in range(len(pools) + len(states)))
    return Program(name, tuple(inputs), tuple(outputs), donation)


def make_entry_fn(cfg: DecoderConfig, block_size: int, num_blocks: int, weight_dtype: str,
                  attention_block: int = 2048, windowed: WindowedKv | None = None,
                  num_state_slots: int = 0, weight_quant: str | None = None,
                  quant_head: bool = False):
    """The function an entry lowers: f(step inputs..., pools..., weights...) -> (logits, pools...)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from . import linear_attention as la_ops
    from .attention import blockwise, one_pass, ring

    slots = weight_slots(cfg, weight_dtype, weight_quant, quant_head)
    slot_of = {s.name: s for s in slots}
    transposed_table = any(s.name == "embed_t" for s in slots)
    # Each layer's pools in @main's order: K and V of the attention layers, then conv and
    # recurrent states of the linear layers.
    pool_of = {}
    for n, layer in enumerate(cfg.attention_layers):
        pool_of[layer] = (2 * n, 2 * n + 1)
    linear_layers = cfg.linear.layers if cfg.linear is not None else ()
    for n, layer in enumerate(linear_layers):
        pool_of[layer] = (2 * len(cfg.attention_layers) + 2 * n,
                          2 * len(cfg.attention_layers) + 2 * n + 1)
    n_pools = 2 * cfg.num_layers
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    group = heads // kv_heads
    act = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}[
        cfg.activation]
    eps = np.float32(cfg.rms_norm_eps)
    highest = lax.Precision.HIGHEST
    bf16 = weight_dtype == "bf16"
    num_slots = num_blocks * block_size
    ring_layers = set(windowed.layers) if windowed is not None else set()
    n_step = 5 + (2 if windowed is not None else 0) + (1 if linear_layers else 0)
    rotary_dim = cfg.rotary_dim or d

    def rms_norm(x, w):
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        return (x * lax.rsqrt(var + eps)) * w

    # Rows of a decode call up to this many run as one matrix-vector product each (an [out, in]
    # artifact): XLA fuses each into a read of the weight, where a GEMM would first widen the
    # whole weight to f32. A weight small enough to stay in the last-level cache is read from
    # memory once for all the rows.
    matvec_rows = 8

    def linear(x, w, out_first):
        if bf16:  # bf16 weights: the input is rounded to bf16, products sum in f32
            # reduce_precision rounds exactly as a bf16 round trip does, but XLA fuses a round
            # trip of converts into every output of a matrix-vector product (SmolLM2 bf16 at one
            # row: 22.4 ms against 11.9 ms).
            x = lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        # The input is computed once, before the product: a reduce is a fusion boundary, and
        # adding zero changes no value. Without it XLA fuses the norm (and the rounding) into
        # the matrix-vector product and recomputes them for every output: SmolLM2 bf16 layers
        # at 4 rows 56 ms against 27 ms, at 1 row 15 ms against 10.7 ms (docs/performance.md).
        x = jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)
        if not out_first:  # f32 [in, out]
            return jnp.matmul(x, w, precision=highest)
        # [out, in] weights hold bf16 values (out_first_linears), and so does the rounded input:
        # their products are exact in f32 and TF32, so no precision=HIGHEST, with which XLA's
        # CPU matrix-vector emitter is 1.3x slower.
        wf = w.astype(jnp.float32)  # fused into the reads below, never materialized at one row
        lead, n_in = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, n_in)
        if flat.shape[0] <= matvec_rows:
            out = jnp.stack([jnp.dot(wf, r) for r in flat])
        else:
            out = lax.dot_general(flat, wf, (((1,), (1,)), ((), ())))
        return out.reshape(*lead, w.shape[0])

    def to_pool(x, dtype):
        """Keys and values as a pool stores them. An fp8 (e4m3fn) pool has no scale: a value is
        stored as itself, clamped to +-448 (e4m3fn has no infinity: a larger value would be
        NaN); attention widens the codes to f32 as it reads them."""
        if dtype == jnp.float8_e4m3fn:
            x = jnp.clip(x, -448.0, 448.0)
        return x.astype(dtype)

    def project(x, w, name):
        """A linear by slot name, in its slot's layout; quantized codes are widened in front of
        the product (exact) and each output column is multiplied by its scale."""
        slot = slot_of[name]
        y = linear(x, w[name], slot.out_first)
        if slot.quant is not None:
            y = y * w[f"{name}.scale"]
        return y

    def rope(x, cos, sin):
        # A partial rotary (qwen3_5) rotates the first rotary_dim dims and passes the rest.
        xr, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        return jnp.concatenate([xr * cos + rotated * sin, rest], axis=-1)

    la = cfg.linear

    def linear_layer(hdn, w, i, conv_pool, rec_pool, positions, seq_lens, state_slots):
        """A Gated DeltaNet layer over the call's rows: each row's states are read at its state
        slot (zero for a row starting at position 0: a reused slot needs no clearing), the row's
        live tokens run through the conv and the rule, and the states are written back (padding
        rows, slot -1, write nothing). Returns (out, conv_pool, rec_pool)."""
        b, t, _ = hdn.shape
        hk, hv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
        kernel, channels, vdim = la.conv_kernel, la.conv_channels, la.value_dim
        proj = project(hdn, w, f"l{i}.lin_in")
        mixed = proj[..., :channels]
        z = proj[..., channels:channels + vdim].reshape(b, t, hv, dv)
        b_in = proj[..., channels + vdim:channels + vdim + hv]
        a_in = proj[..., channels + vdim + hv:]
        read = jnp.where(state_slots < 0, 0, state_slots)
        fresh = (positions[:, 0] == 0)[:, None, None]
        conv_state = jnp.where(fresh, 0.0, jnp.take(conv_pool, read, axis=0))
        rec_state = jnp.where(fresh[..., None], 0.0, jnp.take(rec_pool, read, axis=0))
        live_n = seq_lens - positions[:, 0]  # a row's live tokens (right-aligned)
        pad = (t - live_n)[:, None]
        if t > 1:
            # CAUSAL_CONV1D over each row's live tokens preceded by its history: the history is
            # moved to just before the row's first live token (padding comes first), so the
            # conv never sees a padding input and the new history is the last live inputs.
            combined = jnp.concatenate([conv_state, mixed], axis=1)  # [b, kernel - 1 + t, c]
            j = jnp.arange(t + kernel - 1)[None, :]
            idx = jnp.where(j >= pad + kernel - 1, j, jnp.clip(j - pad, 0, kernel - 2))
            arranged = jnp.take_along_axis(combined, idx[..., None], axis=1)
            conv_state, mixed = arranged[:, :kernel - 1], arranged[:, kernel - 1:]
        mixed, conv_state = la_ops.causal_conv1d(mixed, conv_state, w[f"l{i}.conv"])
        q = mixed[..., :hk * dk].reshape(b, t, hk, dk)
        k = mixed[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
        v = mixed[..., 2 * hk * dk:].reshape(b, t, hv, dv)
        beta = jax.nn.sigmoid(b_in)
        g = -jnp.exp(w[f"l{i}.A_log"]) * jax.nn.softplus(a_in + w[f"l{i}.dt_bias"])
        if t > 1:
            # GATED_DELTA_RULE: a padding token has g = 0 and beta = 0, so it leaves the state
            # as it was. Prefill runs the chunked form, decode the recurrence.
            live = (jnp.arange(t)[None, :] >= pad)[..., None]
            g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
            o, rec_state = la_ops.gated_delta_rule_chunked(q, k, v, g, beta, rec_state)
        else:
            o, rec_state = la_ops.gated_delta_rule_recurrent(q, k, v, g, beta, rec_state)
        o = la_ops.gated_rms_norm(o, z, w[f"l{i}.lin_norm"], cfg.rms_norm_eps).reshape(b, t, vdim)
        out = project(o, w, f"l{i}.lin_out")
        # Padding rows carry slot -1: sent past the pool's end, where mode="drop" skips them.
        # One row gets a second, dropped index so XLA keeps a scatter in place rather than a
        # dynamic-update-slice on a copy of the pool (as for the KV write).
        write = jnp.where(state_slots < 0, num_state_slots, state_slots)
        if b == 1:
            write = jnp.concatenate([write, jnp.array([num_state_slots], jnp.int32)])
            conv_state = jnp.concatenate([conv_state, jnp.zeros_like(conv_state)])
            rec_state = jnp.concatenate([rec_state, jnp.zeros_like(rec_state)])
        conv_pool = conv_pool.at[write].set(conv_state.astype(conv_pool.dtype), mode="drop")
        rec_pool = rec_pool.at[write].set(rec_state.astype(rec_pool.dtype), mode="drop")
        return out, conv_pool, rec_pool

    def mlp_block(x, w, i):
        hdn = rms_norm(x, w[f"l{i}.mlp_norm"])
        gu = project(hdn, w, f"l{i}.gate_up")
        gate, up = gu[..., :cfg.intermediate_size], gu[..., cfg.intermediate_size:]
        mlp = project(act(gate) * up, w, f"l{i}.down")
        if cfg.sandwich_norms:
            mlp = rms_norm(mlp, w[f"l{i}.post_mlp_norm"])
        return x + mlp

    def fn(*args):
        token_ids, positions, block_tables, seq_lens, slot_mapping = args[:5]
        if windowed is not None:
            window_tables, window_slots = args[5:7]
        state_slots = args[n_step - 1] if linear_layers else None
        pools = list(args[n_step:n_step + n_pools])
        w = dict(zip((s.name for s in slots), args[n_step + n_pools:]))
        b, t = token_ids.shape
        m = block_tables.shape[1]
        context = m * block_size

        if transposed_table:  # columns of the [hidden, vocab] table
            x = jnp.moveaxis(jnp.take(w["embed_t"], token_ids, axis=1), 0, -1)
        else:
            x = jnp.take(w["embed"], token_ids, axis=0)
        x = x.astype(jnp.float32)  # [b, t, h]
        if "embed.scale" in w:  # a quantized tied table: each gathered row times its scale
            x = x * jnp.take(w["embed.scale"], token_ids, axis=0)[..., None]
        if cfg.embed_scale is not None:
            x = x * np.float32(cfg.embed_scale)
        rotary = {}  # cos and sin per distinct RoPE (gemma3: one for sliding, one for full)

        def cos_sin(layer):
            key = tuple(cfg.inv_freq(layer).tolist())
            if key not in rotary:
                freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(cfg.inv_freq(layer))
                emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
                rotary[key] = (jnp.cos(emb), jnp.sin(emb))
            return rotary[key]
        # Padding tokens carry slot -1. JAX wraps negative scatter indices, so send them past the
        # pool's end, where mode="drop" skips them: their KV is never written.
        # XLA turns a scatter of one index into a dynamic-update-slice on a copy of the pool (a
        # whole-pool copy per layer and step: measured 0.8 ms per 1.5 MiB pool). A second index,
        # past the end and so dropped, keeps it a scatter, done in place.
        pad_row = b * t == 1

        def scatter_slots(mapping, pool_slots):
            # Padding tokens carry slot -1. JAX wraps negative scatter indices, so send them past
            # the pool's end, where mode="drop" skips them: their KV is never written.
            flat = mapping.reshape(-1)
            flat = jnp.where(flat < 0, pool_slots, flat)
            if pad_row:
                flat = jnp.concatenate([flat, jnp.array([pool_slots], jnp.int32)])
            return flat

        flat_slots = scatter_slots(slot_mapping, num_slots)
        if windowed is not None:
            ring_slots_n = windowed.num_blocks * block_size
            flat_window_slots = scatter_slots(window_slots, ring_slots_n)
            ring_width = min(m, windowed.ring_pages)  # the ring's entries of the window table

        def rows(x):  # a call's K or V rows for the scatter, with the dropped row when padded
            x = x.reshape(b * t, kv_heads, d)
            return jnp.concatenate([x, jnp.zeros_like(x)]) if pad_row else x

        new_pools = list(pools)
        for i in range(cfg.num_layers):
            hdn = rms_norm(x, w[f"l{i}.attn_norm"])
            if i in linear_layers:
                ci, ri = pool_of[i]
                attn, new_pools[ci], new_pools[ri] = linear_layer(
                    hdn, w, i, pools[ci], pools[ri], positions, seq_lens, state_slots)
                x = x + attn
                x = mlp_block(x, w, i)
                continue
            ki, vi = pool_of[i]
            k_pool, v_pool = pools[ki], pools[vi]
            qkv = project(hdn, w, f"l{i}.qkv")
            q_width = 2 * heads * d if cfg.attn_output_gate else heads * d
            if cfg.attn_output_gate:  # per head: [query (d), gate (d)]
                qg = qkv[..., :q_width].reshape(b, t, heads, 2 * d)
                q, gate = qg[..., :d], qg[..., d:].reshape(b, t, heads * d)
            else:
                q = qkv[..., :q_width].reshape(b, t, heads, d)
            k = qkv[..., q_width:q_width + kv_heads * d].reshape(b, t, kv_heads, d)
            v = qkv[..., q_width + kv_heads * d:].reshape(b, t, kv_heads, d)
            if cfg.qk_norm:
                q = rms_norm(q, w[f"l{i}.q_norm"])
                k = rms_norm(k, w[f"l{i}.k_norm"])
            cos, sin = cos_sin(i)
            q, k = rope(q, cos, sin), rope(k, cos, sin)

            # KV_CACHE_WRITE: scatter each token's key and value at its slot (a ring layer: at
            # its slot in the windowed pool).
            pool_shape = k_pool.shape
            on_ring = i in ring_layers
            idx = flat_window_slots if on_ring else flat_slots
            n_slots = pool_shape[0] * block_size
            k_pool = k_pool.reshape(n_slots, kv_heads, d).at[idx].set(
                to_pool(rows(k), k_pool.dtype), mode="drop").reshape(pool_shape)
            v_pool = v_pool.reshape(n_slots, kv_heads, d).at[idx].set(
                to_pool(rows(v), v_pool.dtype), mode="drop").reshape(pool_shape)
            new_pools[ki], new_pools[vi] = k_pool, v_pool

            # PAGED_ATTENTION: a row's pages are gathered once and every token of the row attends
            # over them with its own causal length; a prefill call over several key blocks
            # attends one block at a time (attention.py).
            qg = q.reshape(b, t, kv_heads, group, d)
            window, scale = cfg.window(i), cfg.attn_scale
            if on_ring:  # a sliding layer scores only its ring, masking each slot by its age
                attn = ring(qg, k_pool, v_pool, window_tables[:, :ring_width], positions,
                            seq_lens, window, windowed.ring_pages * block_size, scale)
            elif t > 1 and context > attention_block:
                attn = blockwise(qg, k_pool, v_pool, block_tables, positions, seq_lens,
                                 attention_block, window, scale)
            else:
                attn = one_pass(qg, k_pool, v_pool, block_tables, positions, seq_lens, window,
                                scale)
            attn = attn.reshape(b, t, heads * d)
            if cfg.attn_output_gate:
                attn = attn * jax.nn.sigmoid(gate)
            attn = project(attn, w, f"l{i}.o")
            if cfg.sandwich_norms:
                attn = rms_norm(attn, w[f"l{i}.post_attn_norm"])
            x = x + attn
            x = mlp_block(x, w, i)

        last = rms_norm(x[:, -1, :], w["final_norm"])  # rows are right-aligned
        # The head: a tied model's reads the embedding table (the same buffer as the gather).
        if transposed_table:
            logits = linear(last, w["embed_t"], False)
        elif cfg.tie_word_embeddings:  # [vocab, hidden] is the head's [out, in]
            logits = project(last, w, "embed")  # (scaled per vocab row when quantized)
        else:
            logits = project(last, w, "lm_head")
        return (logits, *new_pools)

    return fn


def lower_entry(cfg: DecoderConfig, program: Program, block_size: int, num_blocks: int,
                weight_dtype: str, attention_block: int = 2048,
                windowed: WindowedKv | None = None, num_state_slots: int = 0,
                weight_quant: str | None = None, quant_head: bool = False) -> str:
    """StableHLO text of one entry; every pool parameter is donated (tf.aliasing_output)."""
    import jax

    from ..manifest import numpy_dtype

    fn = make_entry_fn(cfg, block_size, num_blocks, weight_dtype, attention_block, windowed,
                       num_state_slots, weight_quant, quant_head)
    specs = [jax.ShapeDtypeStruct(s.shape, numpy_dtype(s.dtype)) for s in program.inputs]
    donate = tuple(i for _, i in program.donation)
    lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True).lower(*specs)
    return lowered.as_text()


__all__ = ["WeightSlot", "weight_slots", "kv_pools", "state_pools", "entry_program",
           "make_entry_fn", "lower_entry"]

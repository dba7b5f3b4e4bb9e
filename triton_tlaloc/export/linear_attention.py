"""Gated DeltaNet's two ops in JAX (docs/design.md#linear-attention-state-slots; the qwen3_5
family's linear layers), each returning its output and its updated state:

- CAUSAL_CONV1D: a depthwise causal convolution over each row's tokens, preceded by the row's
  history (the last kernel - 1 inputs, the conv state), then SiLU.
- GATED_DELTA_RULE: per token and value head, with k and q L2-normalized and q scaled by
  1/sqrt(d):  S = S * exp(g);  S += k (x) beta * (v - k^T S);  o = q^T S.
  `gated_delta_rule_recurrent` runs it one token at a time (decode); `gated_delta_rule_chunked`
  runs the same rule in chunks of 64 tokens (prefill): per chunk, matmuls and a unit lower-
  triangular solve (the UT transform, by forward substitution), and a scan over the chunks
  carrying S.

Both match transformers' torch fallbacks (`torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn` / `causal_conv1d_update` in
models/qwen3_5) in f32: tests/test_linear_attention.py.

Shapes: q, k [b, t, hk, dk]; v [b, t, hv, dv] (hv a multiple of hk: each q/k head serves
hv / hk consecutive value heads); g, beta [b, t, hv]; state [b, hv, dk, dv].
`gated_deltanet_layer` is the whole linear layer (projections, conv, rule, gated norm, output
projection) over one call's tokens with its two states.

decoder.py calls these ops for the linear layers of a hybrid model (schema tlaloc-serving-v4).
Everything lowers to plain StableHLO: no custom call (jax's solve_triangular lowers to LAPACK's
trsm on CPU, a custom call that ties an artifact to one platform and that a process which never
lowered anything has not initialized: the Triton backend hung on it).
"""

from __future__ import annotations

import numpy as np

CHUNK = 64


def l2norm(x, eps: float = 1e-6):
    import jax.numpy as jnp
    from jax import lax

    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def causal_conv1d(x, state, weight, bias=None):
    """x [b, t, c]; state [b, k - 1, c] (the previous inputs, oldest first); weight [c, k] (the
    checkpoint's conv1d weight [c, 1, k] squeezed). Returns (SiLU of the convolution [b, t, c],
    the new state: the last k - 1 inputs of history + x)."""
    import jax
    import jax.numpy as jnp

    t = x.shape[1]
    k = weight.shape[1]
    full = jnp.concatenate([state.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    # out[:, i] = sum_j full[:, i + j] * weight[:, j]: k shifted slices, no conv primitive needed
    out = sum(full[:, j:j + t, :] * weight[:, j].astype(jnp.float32) for j in range(k))
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return jax.nn.silu(out), full[:, full.shape[1] - (k - 1):, :]


def _prepare(q, k, v, g, beta):
    """To [b, hv, t, ...] f32, q/k repeated per value head, L2-normalized, q scaled."""
    import jax.numpy as jnp

    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = jnp.repeat(q, hv // hk, axis=2)
        k = jnp.repeat(k, hv // hk, axis=2)
    q, k, v = (jnp.swapaxes(a.astype(jnp.float32), 1, 2) for a in (q, k, v))
    g, beta = (jnp.swapaxes(a.astype(jnp.float32), 1, 2) for a in (g, beta))
    q, k = l2norm(q), l2norm(k)
    q = q * np.float32(q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """One token at a time (lax.scan over t). Returns (o [b, t, hv, dv], state)."""
    import jax.numpy as jnp
    from jax import lax

    q, k, v, g, beta = _prepare(q, k, v, g, beta)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [b, hv, d], [b, hv]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=lax.Precision.HIGHEST)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=lax.Precision.HIGHEST)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
    state, o = lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), state  # [t, b, hv, dv] -> [b, t, hv, dv]


def unit_lower_inverse(strict):
    """(I + strict)^-1 for a strictly lower-triangular strict [..., c, c], by forward
    substitution one row at a time (a while loop of c - 1 steps, as transformers' torch
    fallback does): row i of the inverse is e_i - strict[i] @ inverse, which reads only rows
    above i, already final."""
    import jax.numpy as jnp
    from jax import lax

    c = strict.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(c, dtype=strict.dtype), strict.shape)

    def row(i, inv):
        a_i = lax.dynamic_slice_in_dim(strict, i, 1, axis=-2)  # [..., 1, c]
        e_i = lax.dynamic_slice_in_dim(eye, i, 1, axis=-2)
        new = e_i - jnp.matmul(a_i, inv, precision=lax.Precision.HIGHEST)
        return lax.dynamic_update_slice_in_dim(inv, new, i, axis=-2)

    return lax.fori_loop(1, c, row, eye)


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same rule in chunks of `chunk` tokens (the sequence zero-padded to a multiple: a
    padded token has g = 0 and beta = 0, so it leaves the state as it was). Returns
    (o [b, t, hv, dv], state)."""
    import jax.numpy as jnp
    from jax import lax

    hi = lax.Precision.HIGHEST
    t = q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, _, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    n = (t + pad) // chunk

    def chunks(a):  # [b, h, n*c, ...] -> [b, h, n, c, ...]
        return a.reshape(b, h, n, chunk, *a.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [b, h, n, c]: log decay from the chunk's start
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    # decay between positions j <= i of a chunk; masked above the diagonal before the exp
    pair = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    # The UT system: I + strictly-lower (beta k k^T * decay); solved for the new values and the
    # decayed keys that read the state (a unit lower-triangular solve: its inverse, then two
    # products; the inverse is c x c where the right-hand sides are dk + dv wide).
    kk = jnp.einsum("bhncd,bhnsd->bhncs", k_beta, k, precision=hi) * pair
    inverse = unit_lower_inverse(jnp.where(strict, kk, 0.0))
    new_values = jnp.matmul(inverse, v_beta, precision=hi)
    k_cumdecay = jnp.matmul(inverse, k_beta * jnp.exp(cum)[..., None], precision=hi)
    intra = jnp.where(lower, jnp.einsum("bhncd,bhnsd->bhncs", q, k, precision=hi) * pair, 0.0)
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [b, h, n, 1, 1]

    def over_chunks(s, xs):
        nv, kc, qd, kd, attn, cd = xs
        v_new = nv - jnp.einsum("bhcd,bhdv->bhcv", kc, s, precision=hi)
        o = (jnp.einsum("bhcd,bhdv->bhcv", qd, s, precision=hi)
             + jnp.einsum("bhcs,bhsv->bhcv", attn, v_new, precision=hi))
        s = s * cd + jnp.einsum("bhcd,bhcv->bhdv", kd, v_new, precision=hi)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q_decayed, k_decayed,
                                                intra, chunk_decay))
    state, o = lax.scan(over_chunks, state.astype(jnp.float32), xs)  # o [n, b, h, c, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.swapaxes(o, 1, 2), state


def gated_rms_norm(x, gate, weight, eps: float):
    """Qwen3_5RMSNormGated: RMS-normalize over the last axis, scale by the weight (as stored:
    no 1 + weight here), then multiply by SiLU(gate); f32."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    x = x.astype(jnp.float32)
    x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return weight.astype(jnp.float32) * x * jax.nn.silu(gate.astype(jnp.float32))


def gated_deltanet_layer(x, w: dict, conv_state, rec_state, *, num_k_heads: int,
                         num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
                         chunked: bool = True):
    """One Gated DeltaNet layer over a call's tokens. x [b, t, hidden]; weights in the
    checkpoint's [out, in] layout: in_proj_qkv [2·K + V, hidden], in_proj_z [V, hidden],
    in_proj_b and in_proj_a [hv, hidden], conv1d [2·K + V, kernel], A_log and dt_bias [hv],
    norm [dv], out_proj [hidden, V] (K = hk·dk, V = hv·dv). conv_state [b, kernel - 1, 2·K + V];
    rec_state [b, hv, dk, dv]. Returns (out [b, t, hidden], conv_state, rec_state)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    hi = lax.Precision.HIGHEST

    def proj(a, m):
        return jnp.einsum("bti,oi->bto", a, m.astype(jnp.float32), precision=hi)

    b, t, _ = x.shape
    x = x.astype(jnp.float32)
    key_dim = num_k_heads * head_k_dim
    mixed, conv_state = causal_conv1d(proj(x, w["in_proj_qkv"]), conv_state, w["conv1d"])
    q = mixed[..., :key_dim].reshape(b, t, num_k_heads, head_k_dim)
    k = mixed[..., key_dim:2 * key_dim].reshape(b, t, num_k_heads, head_k_dim)
    v = mixed[..., 2 * key_dim:].reshape(b, t, num_v_heads, head_v_dim)
    beta = jax.nn.sigmoid(proj(x, w["in_proj_b"]))
    g = -jnp.exp(w["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        proj(x, w["in_proj_a"]) + w["dt_bias"].astype(jnp.float32))
    rule = gated_delta_rule_chunked if chunked else gated_delta_rule_recurrent
    o, rec_state = rule(q, k, v, g, beta, rec_state)
    z = proj(x, w["in_proj_z"]).reshape(b, t, num_v_heads, head_v_dim)
    o = gated_rms_norm(o, z, w["norm"], eps).reshape(b, t, num_v_heads * head_v_dim)
    return proj(o, w["out_proj"]), conv_state, rec_state

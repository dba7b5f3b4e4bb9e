"""Gated DeltaNet's ops in JAX (linear_attention.py) against transformers' torch fallbacks of
the qwen3_5 family, and the chunked form against the one-token recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

from triton_tlaloc.export.linear_attention import (causal_conv1d, gated_delta_rule_chunked,
                                            gated_delta_rule_recurrent)

# f32 throughout; the chunked form sums in another order than the recurrence.
TOL = 2e-5


def inputs(t=150, b=2, hk=2, hv=4, dk=16, dv=8, seed=0):
    """Random q/k/v, a decay g <= 0 and beta in (0, 1), an initial state: as the layer makes
    them (g = -exp(A) * softplus(a + dt_bias), beta = sigmoid(b))."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hk, dk), np.float32)
    k = rng.standard_normal((b, t, hk, dk), np.float32)
    v = rng.standard_normal((b, t, hv, dv), np.float32)
    g = -np.exp(rng.standard_normal(hv).astype(np.float32)) * np.log1p(
        np.exp(rng.standard_normal((b, t, hv)).astype(np.float32)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, hv)).astype(np.float32)))
    state = rng.standard_normal((b, hv, dk, dv), np.float32) * 0.1
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), state


def torch_rule(fn, q, k, v, g, beta, state, **kw):
    out, s = fn(*(torch.from_numpy(a) for a in (q, k, v, g, beta)),
                initial_state=torch.from_numpy(state), output_final_state=True,
                use_qk_l2norm_in_kernel=True, **kw)
    return out.numpy(), s.numpy()


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, np.max(np.abs(b))))


def test_recurrent_rule_equals_transformers():
    args = inputs()
    want_o, want_s = torch_rule(ref.torch_recurrent_gated_delta_rule, *args)
    o, s = gated_delta_rule_recurrent(*args)
    assert rel_err(o, want_o) <= TOL and rel_err(s, want_s) <= TOL


def test_chunked_rule_equals_transformers_and_the_recurrence():
    """150 tokens: two whole chunks of 64 and a padded third."""
    args = inputs()
    want_o, want_s = torch_rule(ref.torch_chunk_gated_delta_rule, *args)
    o, s = gated_delta_rule_chunked(*args)
    assert rel_err(o, want_o) <= TOL and rel_err(s, want_s) <= TOL
    rec_o, rec_s = gated_delta_rule_recurrent(*args)
    assert rel_err(o, rec_o) <= TOL and rel_err(s, rec_s) <= TOL


def test_chunked_rule_without_the_decay_fails_the_check():
    """Negative control: the chunked rule with its decay dropped (g = 0) against the
    recurrence with it: far outside the tolerance."""
    q, k, v, g, beta, state = inputs()
    rec_o, _ = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    bad_o, _ = gated_delta_rule_chunked(q, k, v, np.zeros_like(g), beta, state)
    assert rel_err(bad_o, rec_o) > 100 * TOL


@pytest.mark.parametrize("split", [1, 3, 64, 100])
def test_prefill_then_steps_carry_the_state(split):
    """A prompt in one chunked call, then the rest one token at a time from its state, equals
    the whole sequence in one call: the state is all a sequence needs."""
    q, k, v, g, beta, state = inputs(t=130)
    whole_o, whole_s = gated_delta_rule_chunked(q, k, v, g, beta, state)
    o1, s = gated_delta_rule_chunked(*(a[:, :split] for a in (q, k, v, g, beta)), state)
    o2, s = gated_delta_rule_recurrent(*(a[:, split:] for a in (q, k, v, g, beta)), s)
    assert rel_err(jnp.concatenate([o1, o2], axis=1), whole_o) <= TOL
    assert rel_err(s, whole_s) <= TOL


def test_causal_conv_equals_transformers_and_carries_its_state():
    rng = np.random.default_rng(1)
    b, t, c, kernel = 2, 37, 24, 4
    x = rng.standard_normal((b, t, c), np.float32)
    w = rng.standard_normal((c, kernel), np.float32)
    want = ref.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w),
                                None, activation="silu").transpose(1, 2).numpy()
    zero = np.zeros((b, kernel - 1, c), np.float32)
    out, state = causal_conv1d(x, zero, w)
    assert rel_err(out, want) <= TOL
    assert np.array_equal(np.asarray(state), x[:, -(kernel - 1):])
    # The same sequence in two calls (a prompt, then one token, then the rest) from the state.
    a, st = causal_conv1d(x[:, :20], zero, w)
    one, st = causal_conv1d(x[:, 20:21], st, w)
    rest, st = causal_conv1d(x[:, 21:], st, w)
    assert rel_err(jnp.concatenate([a, one, rest], axis=1), want) <= TOL
    # transformers' one-token update, fed its own state layout [b, c, kernel]
    conv_state = torch.from_numpy(np.ascontiguousarray(
        np.concatenate([np.zeros((b, 1, c), np.float32), x[:, 17:20]], axis=1).transpose(0, 2, 1)))
    upd = ref.causal_conv1d_update(torch.from_numpy(x[:, 20:21]).transpose(1, 2), conv_state,
                                   torch.from_numpy(w), None, activation="silu")
    assert rel_err(one, upd.transpose(1, 2).numpy()) <= TOL
    # Negative control: a state one input stale (history shifted) fails the check.
    stale, _ = causal_conv1d(x[:, 20:21], x[:, 16:19], w)
    assert rel_err(stale, one) > 100 * TOL


def test_the_whole_layer_equals_transformers_gated_deltanet():
    """gated_deltanet_layer against transformers' Qwen3_5GatedDeltaNet (seeded random weights,
    a 150-token call from zero states; then the same tokens as a 100-token call and 50 single
    steps carrying both states). Negative control: the conv kernel in the wrong time order."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from triton_tlaloc.export.linear_attention import gated_deltanet_layer

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=8, linear_value_head_dim=8,
                            linear_conv_kernel_dim=4, num_hidden_layers=1,
                            layer_types=["linear_attention"], rms_norm_eps=1e-6)
    layer = ref.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for prm in layer.parameters():  # the norm weight starts at ones: make every weight count
            prm.copy_(torch.randn_like(prm) * 0.3)
    x = np.random.default_rng(2).standard_normal((2, 150, 32)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    w = {n: p.detach().numpy() for n, p in layer.named_parameters()}
    w["conv1d"] = w.pop("conv1d.weight")[:, 0, :]
    w = {n.removesuffix(".weight"): a for n, a in w.items()}
    dims = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, eps=1e-6)
    conv0 = np.zeros((2, 3, 2 * 16 + 32), np.float32)
    rec0 = np.zeros((2, 4, 8, 8), np.float32)
    got, _, _ = gated_deltanet_layer(x, w, conv0, rec0, **dims)
    assert rel_err(got, want) <= TOL
    # A prompt, then one token at a time from the states.
    out, conv, rec = gated_deltanet_layer(x[:, :100], w, conv0, rec0, **dims)
    steps = [out]
    # (compiled once: 50 steps dispatched op by op took 15 s)
    step = jax.jit(lambda xi, c, r: gated_deltanet_layer(xi, w, c, r, chunked=False, **dims))
    for i in range(100, 150):
        o, conv, rec = step(x[:, i:i + 1], conv, rec)
        steps.append(o)
    assert rel_err(jnp.concatenate(steps, axis=1), want) <= TOL
    # Negative control: the conv kernel applied in the wrong time order fails the check.
    flipped = np.ascontiguousarray(w["conv1d"][:, ::-1])
    bad, _, _ = gated_deltanet_layer(x, {**w, "conv1d": flipped}, conv0, rec0, **dims)
    assert rel_err(bad, want) > 100 * TOL

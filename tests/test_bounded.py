"""Bounded programs (tlaloc-bounded-v1) without a server: export, padding to buckets, slicing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triton_tlaloc.programs.bounded import (BOUNDED_MANIFEST, BoundedError, BoundedRuntime,
                                            TensorShape, export_bounded)

BOUND = 16
D = 4


def masked_mean_and_centered(x, L_mask, L_len):
    """The mean over the valid rows of x [L, D], and x minus it (rows past the length: 0)."""
    import jax.numpy as jnp

    m = L_mask[:, None]
    mean = jnp.sum(jnp.where(m, x, 0.0), axis=0) / L_len
    return mean, jnp.where(m, x - mean, 0.0)


def plain_mean(x, L_mask, L_len):  # reads its padding: must be refused
    import jax.numpy as jnp

    return jnp.mean(x, axis=0)


SPEC = [TensorShape("x", "f32", ("L", D))]


@pytest.fixture(scope="module")
def bounded(work):
    return export_bounded(masked_mean_and_centered, SPEC, {"L": BOUND}, work / "bounded-mean")


def test_every_length_up_to_the_bound_equals_the_exact_result(bounded):
    manifest = json.loads((bounded / BOUNDED_MANIFEST).read_text())
    assert manifest["schema"] == "tlaloc-bounded-v1"
    assert manifest["bounds"] == {"L": {"max": 16, "buckets": [1, 2, 4, 8, 16]}}
    assert [o["dims"] for o in manifest["outputs"]] == [[D], ["L", D]]
    rt = BoundedRuntime(bounded)
    rng = np.random.default_rng(0)
    for n in range(1, BOUND + 1):
        x = rng.standard_normal((n, D)).astype(np.float32)
        mean, centered = rt.run({"x": x})
        np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-5, atol=1e-6)
        assert centered.shape == (n, D)
        np.testing.assert_allclose(centered, x - x.mean(axis=0), rtol=1e-5, atol=1e-6)
    assert rt.executions == BOUND


def test_requests_past_the_bound_or_of_the_wrong_shape_are_refused_by_name(bounded):
    rt = BoundedRuntime(bounded)
    with pytest.raises(BoundedError, match=r"input x axis 0 \(L\) is 17, past its bound 16"):
        rt.run({"x": np.zeros((17, D), np.float32)})
    with pytest.raises(BoundedError, match="input x axis 1 must be 4, got 5"):
        rt.run({"x": np.zeros((3, 5), np.float32)})
    with pytest.raises(BoundedError, match="input x must be f32"):
        rt.run({"x": np.zeros((3, D), np.float64)})
    assert rt.executions == 0


def test_a_function_that_reads_its_padding_is_refused(work):
    """Negative control: a plain mean over the padded axis differs from the exact-size mean."""
    with pytest.raises(BoundedError, match="reads its padding"):
        export_bounded(plain_mean, SPEC, {"L": BOUND}, work / "bounded-plain-mean")
    assert not (work / "bounded-plain-mean").exists()


DTYPES = ["i1", "i8", "i16", "i32", "i64", "ui8", "f16", "bf16", "f32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_round_trips_through_an_identity_plus_one_program(dtype, work):
    """The element types Triton and StableHLO share, through a bounded identity-plus-one (a
    logical not for bool): the manifest's names, the compiled program, the padding and slicing."""
    import jax.numpy as jnp

    from triton_tlaloc.artifact.manifest import dtype_name, numpy_dtype

    def plus_one(x, L_mask, L_len):
        return jnp.logical_not(x) if x.dtype == jnp.bool_ else x + jnp.ones((), x.dtype)

    art = export_bounded(plus_one, [TensorShape("x", dtype, ("L", 3))], {"L": 4},
                         work / f"bounded-plus-one-{dtype}", check_lengths=1)
    rt = BoundedRuntime(art)
    x = (np.arange(9).reshape(3, 3) % 2).astype(numpy_dtype(dtype))
    (y,) = rt.run({"x": x})
    assert dtype_name(y.dtype) == dtype and y.shape == (3, 3)
    want = np.logical_not(x) if dtype == "i1" else x + np.ones((), x.dtype)
    assert np.array_equal(y, want)

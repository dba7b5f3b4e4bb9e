"""The layer loop: a model whose layers are alike runs them as one loop over weights and pools
stacked over the layers. Both layouts against transformers (greedy ids equal, logits within the
parity tolerance), a negative control (the stacked layers in reverse order fail the same
check), and the point of the loop: its program does not grow with the layers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from checks.oracle import load_reference, logits_error, reference_greedy
from test_parity import PROMPT, STEPS, TOLERANCE, run_artifact

from triton_tlaloc.export.decoder import STACKED
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import MANIFEST_NAME, numpy_dtype


def check_against_transformers(tiny, art, family, tied, weight_dtype, layers) -> float:
    ref = load_reference(tiny.checkpoint(family, tied, layers),
                         bf16_arithmetic=weight_dtype == "bf16")
    want_ids, want_logits = reference_greedy(ref, PROMPT, STEPS)
    got_ids, got_logits = run_artifact(art)
    err = logits_error(got_logits, want_logits)
    print(f"{art.name}: ids {got_ids}, logits error {err:.2e}")
    return err if got_ids == want_ids else float("inf")


@pytest.mark.parametrize("family,tied,weight_dtype", [("llama", False, "f32"),
                                                      ("qwen3", True, "bf16")])
def test_unrolled_and_loop_both_match_transformers(tiny, family, tied, weight_dtype):
    loop = tiny.artifact(family, tied, weight_dtype, 3)
    unrolled = tiny.artifact(family, tied, weight_dtype, 3, layer_loop=False)
    assert json.loads((loop / MANIFEST_NAME).read_text())["model"]["layerLoop"] is True
    assert json.loads((unrolled / MANIFEST_NAME).read_text())["model"]["layerLoop"] is False
    slots = {w.slot for w in load_artifact(loop).weights}
    assert "layers.qkv" in slots and "l0.qkv" not in slots
    assert "l2.qkv" in {w.slot for w in load_artifact(unrolled).weights}
    for art in (loop, unrolled):
        assert check_against_transformers(tiny, art, family, tied, weight_dtype,
                                          3) <= TOLERANCE[weight_dtype]


def test_layers_in_reverse_order_fail_the_check(tiny, work):
    """Negative control: the loop artifact with every stacked weight's layers reversed (the
    manifest unchanged) runs, and misses transformers by more than the tolerance."""
    src = load_artifact(tiny.artifact("llama", False, "f32", 3))
    bad = work / "art-llama-layers-reversed"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(src.path, bad)
    reversed_slots = 0
    for w in src.weights:
        if w.slot.startswith(STACKED):
            path = bad / w.file
            arr = np.fromfile(path, numpy_dtype(w.dtype)).reshape(w.shape)
            path.write_bytes(np.ascontiguousarray(arr[::-1]).tobytes())
            reversed_slots += 1
    assert reversed_slots >= 6  # norms, qkv, o, gate_up, down
    err = check_against_transformers(tiny, bad, "llama", False, "f32", 3)
    assert err > TOLERANCE["f32"]


def test_loop_program_does_not_grow_with_the_layers(tiny):
    """The same entry at 2 and 4 layers: unrolled, the program doubles its layers' operations;
    as a loop it keeps one layer's (the text differs only in the stacked shapes)."""
    def body_bytes(art):
        a = load_artifact(art)
        return len(a.body_text(a.entries["decode_b1_c32"]))

    loop = [body_bytes(tiny.artifact("llama", False, "f32", n)) for n in (2, 4)]
    unrolled = [body_bytes(tiny.artifact("llama", False, "f32", n, layer_loop=False))
                for n in (2, 4)]
    print(f"decode_b1_c32 StableHLO bytes, 2 and 4 layers: loop {loop}, unrolled {unrolled}")
    assert unrolled[1] > 1.5 * unrolled[0]
    assert abs(loop[1] - loop[0]) < 0.02 * loop[0]


def widened_whole(hlo_text: str, stacked_shapes) -> list[str]:
    """Lines of optimized HLO that convert a whole stacked weight (every layer at once)."""
    dims = [",".join(map(str, s)) for s in stacked_shapes]
    return [line.strip() for line in hlo_text.splitlines()
            if " convert(" in line and any(f"f32[{d}]" in line for d in dims)]


def scan_of_linears(bits: bool):
    """A two-layer stack of bf16 matrix-vector products as the layer loop writes them: the
    stacked weights passed as bf16 (`bits` False) or as their bits, bitcast after the slice."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def fn(x, w):
        def body(h, layer_w):
            if bits:
                layer_w = lax.bitcast_convert_type(layer_w, jnp.bfloat16)
            return h + jnp.dot(layer_w.astype(jnp.float32), h[0])[None], None
        return lax.scan(body, x, w)[0]

    dtype = jnp.uint16 if bits else jnp.bfloat16
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((1, 64), jnp.float32),
                             jax.ShapeDtypeStruct((2, 64, 64), dtype)).compile().as_text()


def test_the_loop_reads_bf16_and_fp8_weights_a_layer_at_a_time(tiny):
    """XLA's CPU backend has no dynamic slice of bf16 or f8 values: given the stacked weights in
    their own type it widens every layer to f32 on each call before slicing one (a bf16
    SmolLM2 step took 142 ms, against 18 unrolled). The loop takes them as their bits
    (manifest.BITS) and bitcasts each layer's slice back, so no compiled entry widens a
    whole stacked weight. Control: the same scan over bf16 weights shows the whole-array
    convert (if XLA stops doing that, this control says the bits are no longer needed)."""
    assert widened_whole(scan_of_linears(bits=False), [(2, 64, 64)])
    assert not widened_whole(scan_of_linears(bits=True), [(2, 64, 64)])

    from triton_tlaloc.runtime.pjrt import PjrtDevice

    device = PjrtDevice("cpu")
    for weight_dtype, opts, bits in (("bf16", {}, "ui16"),
                                     ("f32", {"weight_quant": "fp8"}, "ui8")):
        art = load_artifact(tiny.artifact("llama", False, weight_dtype, 3, **opts))
        stacked = [w for w in art.weights if w.slot.startswith(STACKED) and w.dtype != "f32"]
        taken = art.weight_input_dtypes()
        assert stacked and all(taken[w.slot] == bits for w in stacked), taken
        entry = art.entries["decode_b1_c32"]
        hlo = device.compile(art.body_text(entry)).hlo_modules()[0].to_string()
        assert not widened_whole(hlo, [w.shape for w in stacked])

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

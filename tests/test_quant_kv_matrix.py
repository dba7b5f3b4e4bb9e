"""Every weight quantization (none, int8, fp8, int4 packed) with every KV dtype (f32, fp8), over one key block
and over several, for a short prompt and a long one (several prefill chunks and key blocks),
against transformers computing with the same numbers (the dequantized weights; keys and values
rounded through e4m3fn): greedy ids equal, first logits within test_quant's tolerance. An fp8
pool is held as its bytes (manifest.BITS): the sliding
layers' rings (mistral, gemma3_text) read them too. Negative control: pages read back with the
wrong bitcast (as e5m2) fail the tolerance. int4's packed codes are bytes too (ui8), never
taken for an fp8 pool's or weight's bits."""

from __future__ import annotations

import contextlib

import pytest
from checks.oracle import (fp8_kv_reference, load_reference, logits_error, quantized_reference,
                           reference_greedy)

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, attention, export_artifact
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.runtime.core import Runtime

TOL = 1e-4  # of the largest logit (test_quant.py's, for every quantization)
STEPS = 8
# One context of 64 positions in pages of 8; prompts go in prefill calls of 16. Two entries an
# artifact (decode and prefill at batch 1), so twelve exports stay cheap.
OPTS = dict(batch_ladder=(1,), context_ladder=(64,), block_size=8, prefill_chunk=16,
            prefill_tokens=())
BLOCKS = {
    "one-block": dict(attention_block=64, decode_attention_block=64),
    # prefill in blocks of 16; decode in blocks of 8, or of 16 past 32 positions (a case)
    "several-blocks": dict(attention_block=16, decode_attention_block=(8, 16)),
}
PROMPTS = {
    "short": [1, 17, 99, 3, 200],  # one prefill call, one key block
    "long": [(i * 37 + 11) % 200 + 10 for i in range(40)],  # three calls, up to 48 positions
}
QUANTS = (None, "int8", "fp8")
KV = ("f32", "fp8")


def run_artifact(art, prompt):
    """The logits of the prompt's last token and STEPS greedy ids, through the engine."""
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    first = engine.prefill_chunked(seq)[0]
    engine.free(seq)
    return first, engine.generate_greedy(prompt, STEPS).generated_ids


class Matrix:
    """The tiny llama's artifacts and transformers' answers, each made once, by key."""

    def __init__(self, tiny):
        self.tiny = tiny
        self.ckpt = tiny.checkpoint("llama", False)
        self._refs: dict = {}

    def artifact(self, quant, kv, blocks):
        extra = {} if quant is None else {"weight_quant": quant}
        return self.tiny.artifact("llama", False, **OPTS, **BLOCKS[blocks], kv_dtype=kv, **extra)

    def reference(self, quant, kv, prompt):
        key = (quant, kv, prompt)
        if key not in self._refs:
            model = load_reference(self.ckpt)
            if quant is not None:
                model = quantized_reference(model, quant)
            with fp8_kv_reference(model) if kv == "fp8" else contextlib.nullcontext():
                self._refs[key] = reference_greedy(model, PROMPTS[prompt], STEPS)
        return self._refs[key]


@pytest.fixture(scope="module")
def matrix(tiny):
    return Matrix(tiny)


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "f32-weights")
def test_quantization_and_kv_dtype_equal_transformers(matrix, quant, kv, blocks):
    art = matrix.artifact(quant, kv, blocks)
    loaded = load_artifact(art)
    assert {p.dtype for p in loaded.pools} == {"f32" if kv == "f32" else "f8E4M3FN"}
    body = loaded.body_text(loaded.entries["decode_b1_c64"])
    # the layer loop is a while too: several key blocks add a loop per block size and the case
    # that chooses one
    assert ("stablehlo.case" in body) == (blocks == "several-blocks")
    assert body.count("stablehlo.while") == (3 if blocks == "several-blocks" else 1)
    for prompt in PROMPTS:
        want_ids, want = matrix.reference(quant, kv, prompt)
        logits, ids = run_artifact(art, PROMPTS[prompt])
        err = logits_error(logits, want)
        print(f"weights {quant or 'f32'}, KV {kv}, {blocks}, {prompt} prompt: "
              f"logits error {err:.2e}")
        assert ids == want_ids, prompt
        assert err <= TOL, prompt


def test_int4_weights_with_fp8_pools_equal_transformers(matrix):
    """Packed int4 codes (bytes, ui8) beside fp8 pools taken as their bytes (ui8 too): neither
    is read as the other, over several key blocks, for both prompts."""
    test_quantization_and_kv_dtype_equal_transformers(matrix, "int4", "fp8", "several-blocks")


def test_fp8_pools_are_taken_as_their_bytes_and_donated(matrix):
    """The manifest's pools are e4m3fn; the programs take and return them as their bytes (ui8),
    each result aliasing its parameter (donated), and bitcast only the pages they read and the
    codes they write, never a whole pool (XLA's CPU backend would copy it)."""
    loaded = load_artifact(matrix.artifact("int8", "fp8", "several-blocks"))
    assert {p.dtype for p in loaded.pools} == {"f8E4M3FN"}
    pool_type = "x".join(map(str, loaded.pools[0].shape))
    for name in ("decode_b1_c64", "prefill_b1_c64"):
        body = loaded.body_text(loaded.entries[name])
        main = body[body.index("func.func public @main"):]
        params, results = main[:main.index("{\n")].split(") -> (")
        assert params.count(f"{pool_type}xui8> {{tf.aliasing_output") == 2, name
        assert "f8E4M3FN" not in params and results.count(f"{pool_type}xui8>") == 2, name
        converts = [line for line in body.splitlines() if "stablehlo.bitcast_convert" in line]
        assert any("f8E4M3FN" in line for line in converts), name
        assert not any(f"{pool_type}x" in line for line in converts), name


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_fp8_rings_equal_transformers(tiny, work, family):
    """Sliding layers over their rings of fp8 pages (gemma3_text: rings and full layers, its
    layers unrolled): a prompt of several windows, against transformers with fp8 keys and
    values."""
    ckpt = tiny.window_checkpoint(family)
    opts = ExportOptions(batch_ladder=(1,), context_ladder=(64,), block_size=4,
                         prefill_chunk=8, prefill_tokens=(), attention_block=16,
                         kv_dtype="fp8")
    art = export_artifact(ckpt, work / f"art-kv-matrix-{family}-fp8", opts)
    loaded = load_artifact(art)
    assert any(p.pool_class == "windowed" and p.dtype == "f8E4M3FN" for p in loaded.pools)
    model = load_reference(ckpt)
    with fp8_kv_reference(model):
        want_ids, want = reference_greedy(model, PROMPTS["long"], STEPS)
    logits, ids = run_artifact(art, PROMPTS["long"])
    err = logits_error(logits, want)
    print(f"{family} fp8 rings: logits error {err:.2e}")
    assert ids == want_ids
    assert err <= TOL


def test_wrong_bitcast_fails_the_tolerance(matrix, work, monkeypatch):
    """Negative control: an fp8 pool's pages read back as e5m2 (the wrong format), int8
    weights over several key blocks, the long prompt; the error is far above the tolerance."""
    import jax.numpy as jnp
    from jax import lax

    def wrong(pages):
        if pages.dtype == attention.FP8_BITS:
            return lax.bitcast_convert_type(pages, jnp.float8_e5m2)
        return pages

    monkeypatch.setattr(attention, "from_bits", wrong)
    art = export_artifact(matrix.ckpt, work / "art-kv-matrix-wrong-bitcast",
                          ExportOptions(**OPTS, **BLOCKS["several-blocks"], kv_dtype="fp8",
                                        weight_quant="int8"))
    monkeypatch.undo()
    _, want = matrix.reference("int8", "fp8", "long")
    logits, _ = run_artifact(art, PROMPTS["long"])
    err = logits_error(logits, want)
    print(f"fp8 pages read as e5m2: logits error {err:.2e}")
    assert err > 100 * TOL

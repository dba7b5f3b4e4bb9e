"""@main's signature read from StableHLO text without JAX (what load_artifact checks bodies
with), and the copying control's text."""

from __future__ import annotations

from triton_tlaloc.artifact.stablehlo import parse_main_signature, strip_aliasing


def test_parse_main_signature_reads_types_and_aliases():
    text = ('module @m {\n  func.func public @main(%arg0: tensor<2x3xf32> {tf.aliasing_output = 1 : i32},'
            ' %arg1: tensor<i32> {mhlo.sharding = "{replicated}"}) -> (tensor<2xf32> '
            '{jax.result_info = "result[0]"}, tensor<2x3xf32>) {\n')
    sig = parse_main_signature(text)
    assert sig.inputs == ("tensor<2x3xf32>", "tensor<i32>")
    assert sig.outputs == ("tensor<2xf32>", "tensor<2x3xf32>")
    assert sig.aliases == ((1, 0),)
    assert parse_main_signature(strip_aliasing(text)).aliases == ()

"""Generic StableHLO programs without Triton (program.py): specialization of dynamic shapes,
bindings, state kept in place, batching by row shape, refusals by name."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc.programs.bounded import TensorShape
from triton_tlaloc.export import program as export_program
from triton_tlaloc.programs.generic import (ARGUMENT_KINDS, RESULT_KINDS, Binding, ProgramError,
                                            ProgramRuntime, batch_bucket, parse_bindings,
                                            plan_groups, run_batch)
from triton_tlaloc.artifact.stablehlo import read_signature, specialize

from checks.programs import ROW_SCALE, rows_program, running_sum

HAND_WRITTEN = """
module @affine {
  func.func public @main(%x: tensor<2x3xf32>, %w: tensor<3xf32>) -> tensor<2x3xf32> {
    %b = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<3xf32>) -> tensor<2x3xf32>
    %y = stablehlo.multiply %x, %b : tensor<2x3xf32>
    return %y : tensor<2x3xf32>
  }
}
"""


def bindings(arguments: str, results: str):
    return (parse_bindings(arguments, ARGUMENT_KINDS, "arguments"),
            parse_bindings(results, RESULT_KINDS, "results"))


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    d = tmp_path_factory.mktemp("programs")
    out = {
        "rows": export_program(rows_program, [TensorShape("x", "f32", ("b", "w")),
                                              TensorShape("w", "f32", (1,))], d / "rows.mlir"),
        "sum": export_program(running_sum, [TensorShape("x", "f32", (4,)),
                                            TensorShape("state", "f32", (4,))], d / "sum.mlir"),
        "affine": d / "affine.mlir",
    }
    out["affine"].write_text(HAND_WRITTEN)
    np.array([ROW_SCALE], np.float32).tofile(d / "scale.bin")
    np.save(d / "w.npy", np.array([1, 2, 3], np.float32))
    return out


def test_signature_and_specialization(programs):
    sig = read_signature(programs["rows"].read_text())
    assert [str(t) for t in sig.inputs] == ["f32[?, ?]", "f32[1]"]
    assert [str(t) for t in sig.results] == ["f32[?, ?]"]
    text = specialize(programs["rows"].read_text(), [(4, 5), (1,)], {})
    static = read_signature(text)
    assert [str(t) for t in static.inputs] == ["f32[4, 5]", "f32[1]"]
    assert [str(t) for t in static.results] == ["f32[4, 5]"]
    assert "?" not in text
    # The alias comes from the bindings, on the new @main.
    text = specialize(programs["sum"].read_text(), [(4,), (4,)], {1: 1})
    assert "tf.aliasing_output = 1" in text


def test_rows_at_any_width_with_a_weight_file(programs):
    rt = ProgramRuntime(programs["rows"], *bindings("input:X,weight:scale.bin", "output:Y"))
    rng = np.random.default_rng(0)
    for shape in ((1, 3), (4, 5), (4, 3), (2, 7)):
        x = rng.standard_normal(shape).astype(np.float32)
        y = rt.run({"X": x})["Y"]
        np.testing.assert_allclose(y, x * ROW_SCALE + x.sum(-1, keepdims=True), atol=1e-5)
    assert rt.executions == 4 and rt.compiles == 4
    rt.run({"X": np.ones((4, 5), np.float32)})  # a shape seen before: no compile
    assert rt.compiles == 4
    # Negative control: the same rows without the weight (scale 1) are told apart.
    x = rng.standard_normal((2, 3)).astype(np.float32)
    assert np.max(np.abs(rt.run({"X": x})["Y"] - (x + x.sum(-1, keepdims=True)))) > 1e-3


def test_a_hand_written_static_program_and_an_npy_weight(programs):
    rt = ProgramRuntime(programs["affine"], *bindings("input:X,weight:w.npy", "output:Y"))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(rt.run({"X": x})["Y"], x * np.array([1, 2, 3], np.float32))
    assert rt.compiles == 1  # a static program is compiled at load
    with pytest.raises(ProgramError, match=r"input X must be f32\[2, 3\], got float32 \[3, 3\]"):
        rt.run({"X": np.ones((3, 3), np.float32)})


def test_state_kept_in_place_between_runs_and_the_copying_control(programs):
    args, results = bindings("input:X,state:total", "output:TOTAL,state:total")
    kept = ProgramRuntime(programs["sum"], args, results)
    copied = ProgramRuntime(programs["sum"], args, results, donate_state=False)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-9, 10, 4).astype(np.float32) for _ in range(6)]
    for k, x in enumerate(xs):
        want = np.sum(xs[:k + 1], axis=0)
        for rt in (kept, copied):
            np.testing.assert_array_equal(rt.run({"X": x})["TOTAL"], want)
    np.testing.assert_array_equal(kept.state_value("total"), np.sum(xs, axis=0))
    assert (kept.state.in_place, kept.state.copied) == (6, 0)
    assert (copied.state.in_place, copied.state.copied) == (0, 6)
    # A refused request leaves the state as it was.
    with pytest.raises(ProgramError, match=r"input X must be f32\[4\]"):
        kept.run({"X": np.ones(5, np.float32)})
    np.testing.assert_array_equal(kept.state_value("total"), np.sum(xs, axis=0))


@pytest.mark.parametrize("arguments, results, message", [
    ("input:X", "output:TOTAL,state:total", r"@main takes 2 arguments"),
    ("input:X,state:total", "output:TOTAL,output:T2", r"state total: needs exactly one result"),
    ("input:X,state:a", "output:TOTAL,state:b", r"state a: needs exactly one result"),
    ("input:X,weight:missing.bin", "output:TOTAL,output:S", r"no such file"),
    ("input:X,weight:../up.bin", "output:TOTAL,output:S", r"named relative to the program"),
    ("input:X,weight:/abs.bin", "output:TOTAL,output:S", r"named relative to the program"),
    ("input:X,input:X", "output:A,output:B", r"X is bound twice"),
    ("input:X,bogus:Y", "output:A,output:B", r"expected KIND:NAME"),
])
def test_bindings_refused_by_name(programs, arguments, results, message):
    with pytest.raises(ProgramError, match=message):
        ProgramRuntime(programs["sum"], *bindings(arguments, results))


def test_weight_file_of_the_wrong_size_refused(programs, tmp_path):
    bad = programs["rows"].parent / "short.bin"
    np.zeros(3, np.float32).tofile(bad)
    with pytest.raises(ProgramError, match=r"weight:short.bin\): 12 bytes, f32\[1\] needs 4"):
        ProgramRuntime(programs["rows"], *bindings("input:X,weight:short.bin", "output:Y"))


def test_plan_groups():
    keys = ["a", "b", "a", "a", "b", "c", "a"]
    assert plan_groups(keys, True) == [[0, 2, 3, 6], [1, 4], [5]]
    assert plan_groups(keys, False) == [[0], [1], [2, 3], [4], [5], [6]]
    assert [batch_bucket(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert batch_bucket(5, 6) == 6


def test_run_batch_groups_rows_by_shape(programs):
    rt = ProgramRuntime(programs["rows"], *bindings("input:X,weight:scale.bin", "output:Y"))
    rng = np.random.default_rng(2)
    widths = [3, 5, 3, 3, 5, 5, 3, 5]
    rows = [1, 2, 1, 3, 1, 1, 2, 1]
    requests = [{"X": rng.standard_normal((n, w)).astype(np.float32)}
                for n, w in zip(rows, widths)]
    requests.insert(3, {"X": np.ones((1, 3), np.int32)})  # refused alone
    requests.append({"X": np.ones((0, 3), np.float32)})  # no rows: refused alone
    answers = {}
    for by_shape in (True, False):
        before = rt.executions
        answers[by_shape] = run_batch(rt, requests, group_by_shape=by_shape, max_batch=16)
        answers[by_shape, "executions"] = rt.executions - before
    assert answers[True, "executions"] == 2
    # runs of one width: 3 | 5 | 3 | (refused) | 3 | 5 5 | 3 | 5
    assert answers[False, "executions"] == 7
    for r, req in enumerate(requests):
        if r in (3, len(requests) - 1):
            for by_shape in (True, False):
                assert isinstance(answers[by_shape][r], ProgramError)
                assert ("input X must be f32" if r == 3 else "at least one row") in str(
                    answers[by_shape][r])
            continue
        x = req["X"]
        np.testing.assert_allclose(answers[True][r]["Y"], x * ROW_SCALE + x.sum(-1, keepdims=True),
                                   atol=1e-5)
        np.testing.assert_array_equal(answers[True][r]["Y"], answers[False][r]["Y"])


def test_static_rows_compile_every_batch_bucket_at_load(tmp_path):
    p = export_program(lambda x: x * 2, [TensorShape("x", "f32", ("b", 3))], tmp_path / "s.mlir")
    rt = ProgramRuntime(p, [Binding("input", "X")], [Binding("output", "Y")])
    assert rt.precompile_batches(12) == 5  # batches 1, 2, 4, 8, 12
    answers = run_batch(rt, [{"X": np.ones((n, 3), np.float32)} for n in (3, 2, 4)],
                        group_by_shape=True, max_batch=12)
    assert rt.compiles == 5 and rt.executions == 1  # 9 rows padded to 12: no new compile
    np.testing.assert_array_equal(answers[1]["Y"], np.full((2, 3), 2, np.float32))


def test_dynamic_rows_are_not_precompiled(programs):
    rt = ProgramRuntime(programs["rows"], *bindings("input:X,weight:scale.bin", "output:Y"))
    assert rt.precompile_batches(16) == 0 and rt.compiles == 0


def test_run_batch_on_a_static_batch_pads_to_it(programs):
    rt = ProgramRuntime(programs["affine"], *bindings("input:X,weight:w.npy", "output:Y"))
    answers = run_batch(rt, [{"X": np.ones((1, 3), np.float32)}], group_by_shape=True,
                        max_batch=2)
    np.testing.assert_array_equal(answers[0]["Y"], [[1, 2, 3]])
    answers = run_batch(rt, [{"X": np.ones((3, 3), np.float32)}], group_by_shape=True,
                        max_batch=2)
    assert "3 rows: the program's batch is 2" in str(answers[0])


def test_inconsistent_dynamic_shapes_refused_by_name(tmp_path):
    """A program whose two inputs share a symbolic size: mismatched sizes are refused by the
    program's own shape assertion, as a ProgramError."""
    p = export_program(lambda a, b: a + b, [TensorShape("a", "f32", ("n",)),
                                            TensorShape("b", "f32", ("n",))], tmp_path / "ab.mlir")
    rt = ProgramRuntime(p, [Binding("input", "A"), Binding("input", "B")],
                        [Binding("output", "C")])
    np.testing.assert_array_equal(rt.run({"A": np.ones(3, np.float32),
                                          "B": np.ones(3, np.float32)})["C"], [2, 2, 2])
    with pytest.raises(ProgramError, match=r"inputs A\[3\], B\[4\] do not fit the program"):
        rt.run({"A": np.ones(3, np.float32), "B": np.ones(4, np.float32)})


def test_an_int64_state_keeps_its_width(tmp_path):
    """64-bit values survive the runtime's zeros and puts (JAX narrows them unless x64 is on)."""
    p = export_program(running_sum, [TensorShape("x", "i64", (2,)),
                                     TensorShape("state", "i64", (2,))], tmp_path / "i.mlir")
    rt = ProgramRuntime(p, *bindings("input:X,state:t", "output:Y,state:t"))
    big = np.array([2 ** 40, -3], np.int64)
    rt.run({"X": big})
    y = rt.run({"X": big})["Y"]
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, 2 * big)
    assert rt.state_value("t").dtype == np.int64 and rt.state.in_place == 2

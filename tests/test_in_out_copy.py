"""The layer loop's [in, out] copy of its linears, one buffer per layer (export/decoder.py
in_out_copies): calls of more than layers.IN_OUT_ROWS rows read it, each layer its own buffer,
calls of fewer the [out, in] stacks, and both give the ids and logits the artifact without the
copy gives (docs/performance.md, "A second copy of the linears for many rows"). The control:
layers 0 and 1 of a copy swapped moves the 16-row calls' logits past the tolerance."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checks.weight_edits import weight_arrays, with_weights_changed
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime.core import Runtime

# The same sums over another layout: XLA may add in another order.
SAME_TOL = 1e-5
STEPS = 6
LADDER = dict(batch_ladder=(1, 16), mixed_tokens=(16,), mixed_batches=(16,))


@pytest.fixture(scope="module")
def arts(tiny):
    """(with the copy, without it): llama, the layer loop, decode batches 1 and 16."""
    return (tiny.artifact("llama", False, in_out_copy=True, **LADDER),
            tiny.artifact("llama", False, **LADDER))


def prompts(seed: int, n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 200, int(k)))) for k in rng.integers(4, 40, n)]


def decode_together(engine: Engine, ps: list[list[int]]) -> tuple[list[list[int]], list]:
    """Each prompt prefilled, then STEPS decode calls of all of them; the ids and each
    call's logits."""
    seqs = [engine.new_sequence(p) for p in ps]
    ids = [[int(np.argmax(engine.prefill_chunked(s)[0]))] for s in seqs]
    logits = []
    for _ in range(STEPS):
        for s, i in zip(seqs, ids):
            s.token_ids.append(i[-1])
        out = engine.decode(seqs)
        logits.append(np.asarray(out))
        for k, i in enumerate(ids):
            i.append(int(np.argmax(out[k])))
    for s in seqs:
        engine.free(s)
    return ids, logits


def test_the_copy_is_stored_transposed_a_buffer_per_layer(arts):
    with_copy, without = arts
    weights = {w["slot"]: w for w in json.loads(
        (with_copy / "tlaloc-serving.json").read_text())["weights"]}
    stacks = {w["slot"]: w for w in json.loads(
        (without / "tlaloc-serving.json").read_text())["weights"]
        if w["slot"].startswith("layers.") and "norm" not in w["slot"]}
    layers = next(iter(stacks.values()))["shape"][0]
    copies = sorted(s for s in weights if s.endswith(".in_out"))
    assert copies == sorted(f"l{i}.{s[len('layers.'):]}.in_out" for s in stacks
                            for i in range(layers))
    for name, stack in stacks.items():
        _, n_out, n_in = stack["shape"]
        assert weights[f"l{layers - 1}.{name[len('layers.'):]}.in_out"]["shape"] == [n_in, n_out]


def test_calls_of_16_rows_and_prompts_give_the_ids_and_logits_without_the_copy(arts):
    with_copy, without = arts
    ps = prompts(0)
    a, b = Engine(Runtime(with_copy)), Engine(Runtime(without))
    (ids_a, logits_a), (ids_b, logits_b) = decode_together(a, ps), decode_together(b, ps)
    assert a.last_entry.startswith("decode_b16_")  # 8 sequences, a call of 16 rows
    assert ids_a == ids_b
    scale = max(float(np.max(np.abs(x))) for x in logits_b)
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(logits_a, logits_b)) <= \
        SAME_TOL * scale
    # one sequence alone: 1-row decode calls (the [out, in] stacks) and its prompt's call
    assert (a.generate_greedy(ps[0], STEPS).generated_ids
            == b.generate_greedy(ps[0], STEPS).generated_ids)


def test_control_a_wrong_copy_fails_the_tolerance(arts, tmp_path):
    with_copy, without = arts
    # layer 0's copy holds layer 1's weights and back (a product on the wrong layer's buffer)
    first, second = weight_arrays(with_copy, ["l0.gate_up.in_out", "l1.gate_up.in_out"]).values()
    wrong = with_weights_changed(with_copy, tmp_path / "wrong",
                                 {"l0.gate_up.in_out": lambda a: second,
                                  "l1.gate_up.in_out": lambda a: first})
    ps = prompts(1)
    engines = Engine(Runtime(wrong)), Engine(Runtime(without))
    (_, bad), (_, good) = (decode_together(e, ps) for e in engines)
    scale = max(float(np.max(np.abs(x))) for x in good)
    assert np.max(np.abs(bad[0] - good[0])) > SAME_TOL * scale


def test_tlaloc_export_writes_the_copy_by_default():
    from triton_tlaloc.cli.parsers import build_parser

    parser = build_parser()
    assert not parser.parse_args(["export", "ckpt", "out"]).no_in_out_copy
    assert parser.parse_args(["export", "ckpt", "out", "--no-in-out-copy"]).no_in_out_copy

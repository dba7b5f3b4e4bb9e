"""Mixed entries on real programs: decode rows and a prompt's chunk in one call give the ids
and logits they give in calls of their own (docs/design.md#mixed-steps), for every kind of
layer and pool the families have (CASES). Streams decode while
a 100-token prompt runs in chunks beside them; every stream and the prompt keep their solo
greedy ids, and a mixed row's logits match the decode call's within SAME_TOL. The control: the
same call with the chunk's positions one off fails that tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc.engine import steps
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime.core import Runtime

# Same program family, different executables and shapes: sums may run in another order.
SAME_TOL = 1e-5
STEPS = 8

# llama with the layer loop, attending block by block (key blocks of 32 positions: a context
# of 128 spans four); qwen3 (q/k norms) unrolled, in one pass; llama's linears quantized.
CASES = {
    "llama-loop-blockwise": ("llama", dict(decode_attention_block=(32,), attention_block=(32,))),
    "qwen3-unrolled": ("qwen3", dict(layer_loop=False)),
    # quantized linears: int8 codes and a scale per channel; 4-bit codes packed two a byte
    "llama-int8": ("llama", dict(weight_quant="int8")),
    "llama-int4": ("llama", dict(weight_quant="int4")),
    # fp8 KV pools: the one scatter writes every token's codes, both groups read them
    "llama-fp8-kv": ("llama", dict(kv_dtype="fp8")),
    # sliding layers over rings (window 8) beside a full layer; rings of 3 pages (chunks of
    # 16 past the window), 8 of them (the sequences of a test)
    "gemma3-rings": ("gemma3_text", dict(prefill_chunk=16, window_blocks=25)),
    # experts (5, top 2): every token of the row routed at once, the chunk's padding uncounted
    "qwen3-moe": ("qwen3_moe", {}),
    # linear-attention layers beside attention ones: each group's conv and recurrent states
    # read and written at its own rows' state slots
    "qwen3_5-state-slots": ("qwen3_5_text", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tiny):
    family, opts = CASES[request.param]
    art = tiny.artifact(family, False, batch_ladder=(1, 4), mixed_tokens=(16, 64), **opts)
    return Engine(Runtime(art))


def prompts(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 200, n))) for n in (5, 30, 12)], \
        list(map(int, rng.integers(3, 200, 100)))


def test_streams_and_a_chunked_prompt_beside_them_keep_their_solo_ids(engine):
    streams, long = prompts(0)
    solo = [engine.generate_greedy(p, STEPS).generated_ids for p in streams + [long]]
    seqs = [engine.new_sequence(p) for p in streams]
    ids = [[int(np.argmax(engine.prefill_chunked(s)[0]))] for s in seqs]
    for s, i in zip(seqs, ids):
        s.token_ids.append(i[0])
    chunked = engine.new_sequence(long)
    calls = 0
    while chunked.uncached:
        out = engine.mixed(seqs, chunked, 16)
        assert out is not None and engine.last_entry.startswith("mixed_b4_")
        calls += 1
        for k, s in enumerate(seqs):
            ids[k].append(int(np.argmax(out[k])))
            s.token_ids.append(ids[k][-1])
    assert calls == 7  # 100 tokens in chunks of 16
    first = [int(np.argmax(out[-1]))]
    chunked.token_ids.append(first[0])
    for _ in range(STEPS - 1):
        first.append(int(np.argmax(engine.decode([chunked])[0])))
        chunked.token_ids.append(first[-1])
    assert [i[:STEPS] for i in ids] + [first] == solo
    for s in seqs + [chunked]:
        engine.free(s)


def test_a_mixed_rows_logits_are_the_decode_calls(engine, monkeypatch):
    streams, long = prompts(1)

    def started():
        seqs = [engine.new_sequence(p) for p in streams]
        for s in seqs:
            s.token_ids.append(int(np.argmax(engine.prefill_chunked(s)[0])))
        return seqs

    # The same streams twice (a linear layer's state steps once per call, so a position is
    # not run again): one copy's decode call, the other's mixed call beside a prompt.
    apart, together = started(), started()
    alone = engine.decode(apart)
    prompt = engine.new_sequence(long[:24])
    mixed = engine.mixed(together, prompt, 64)
    prompt_alone = engine.new_sequence(long[:24])
    want_prompt = engine.prefill_chunked(prompt_alone)[0]
    scale = max(1.0, float(np.max(np.abs(alone))))
    assert np.max(np.abs(mixed[:-1] - alone)) <= SAME_TOL * scale
    assert np.max(np.abs(mixed[-1] - want_prompt)) <= SAME_TOL * scale
    # The control: the chunk's positions one off (RoPE and the causal mask move) fails it.
    from triton_tlaloc.engine import core

    wrong = engine.new_sequence(long[:24])

    def shifted(*args):
        step = steps.build_mixed_step(*args)
        step["CHUNK_POSITIONS"] = step["CHUNK_POSITIONS"] + 1
        return step

    for s, row in zip(apart, alone):
        s.token_ids.append(int(np.argmax(row)))
    monkeypatch.setattr(core, "build_mixed_step", shifted)
    off = engine.mixed(apart, wrong, 64)
    assert np.max(np.abs(off[-1] - want_prompt)) > SAME_TOL * scale
    for s in apart + together + [prompt, prompt_alone, wrong]:
        engine.free(s)


def test_the_export_writes_mixed_entries_by_default_where_a_model_can_take_them():
    from triton_tlaloc.cli.parsers import build_parser
    from triton_tlaloc.export.options import ExportOptions
    from triton_tlaloc.export.writer import _mixed_tokens, mixed_batches

    args = build_parser().parse_args(["export", "ckpt", "out"])
    assert (args.batch_ladder, args.mixed_tokens, args.mixed_batches) == (
        (1, 2, 4, 8, 16), (64, 192), (4, 16))
    opts = ExportOptions(batch_ladder=(1, 2, 4, 8, 16), context_ladder=(512, 4096),
                         mixed_tokens=(64, 192), mixed_batches=(4, 16))
    assert opts.resolved_num_blocks() == 1025  # the pool of batches to 4: 4 x 4,096 tokens
    assert mixed_batches(opts) == [4, 16]
    # no batch above the ladder's largest
    assert mixed_batches(ExportOptions(batch_ladder=(1, 2), mixed_batches=(4, 16))) == [2]
    # every family takes them (the cases above run rings, experts and state slots; tests/
    # test_lora.py adapters); a program over several devices does not yet
    assert _mixed_tokens(opts) == (64, 192)
    assert _mixed_tokens(ExportOptions(mixed_tokens=(64,), tensor_parallel=2)) == ()

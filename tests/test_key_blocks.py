"""Attention that follows the sequence, per family: decode and prefill entries whose context
spans several key blocks loop over the blocks their rows hold (export/attention.py
`blockwise`) and give the one-pass form's greedy ids and logits, through the engine, with rows
at and one past block boundaries and a padding row in every decode call, on both sides of
the length at which decode calls switch from the many-rows block to larger ones. Negative
control: the loop one block short fails the tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from checks.oracle import logits_error

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.export import attention
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.runtime.core import Runtime

TOL = 1e-5  # of the largest logit, f32: the same products summed in another order
# One context of 8 key blocks of 8 positions (one page each); prompts go in chunks of 16, so
# prefill calls cross blocks too. Batch 4: three sequences decode with one padding row.
OPTS = dict(batch_ladder=(1, 4), context_ladder=(64,), block_size=8, prefill_chunk=16)
ONE_PASS = dict(attention_block=64, decode_attention_block=64)
# Decode calls of 4 rows take blocks of 8 (the many-rows block), or of 16 once the call holds
# more than 32 positions; calls of one row blocks of 16 only.
KEY_BLOCKS = dict(attention_block=8, decode_attention_block=16, many_rows_attention_block=8)
# Prompts ending one before, at and past block boundaries. The first two decode together for
# SHORT_STEPS steps (lengths up to 23 and 24: blocks of 8), then all three (33 and more: blocks
# of 16) for the rest, carrying every row over several more boundaries.
PROMPTS = [[(i * 37 + 11 + 5 * n) % 200 + 10 for i in range(length)]
           for n, length in enumerate((15, 16, 33))]
STEPS, SHORT_STEPS = 24, 8
FAMILIES = {
    "llama": lambda tiny: tiny.checkpoint("llama", False),
    "qwen3": lambda tiny: tiny.checkpoint("qwen3", True),
    # every layer sliding: its window is a mask over full-history pages, so the loop's window
    # start (the first block a row can see) is what is checked
    "mistral": lambda tiny: tiny.window_checkpoint("mistral"),
    "gemma3_text": lambda tiny: tiny.window_checkpoint("gemma3_text"),  # rings + full layers
    "qwen3_5_text": lambda tiny: tiny.checkpoint("qwen3_5_text", False),  # its attention layer
}


def export(tiny, work, family: str, name: str, **blocks):
    extra = {"windowed_kv": False} if family == "mistral" else {}
    return export_artifact(FAMILIES[family](tiny), work / f"art-key-blocks-{family}-{name}",
                           ExportOptions(**OPTS, **extra, **blocks))


def logits_of_every_call(art, forced: list[list[int]] | None = None):
    """Each prompt prefilled alone; the first two decoded together for SHORT_STEPS steps, then
    the three for the rest of STEPS. Each call's logits (a row per sequence, in order) and the
    tokens fed (the greedy ones, or `forced`)."""
    engine = Engine(Runtime(art))
    seqs = [engine.new_sequence(p) for p in PROMPTS]
    logits = [[engine.prefill_chunked(s)[0] for s in seqs]]
    last = list(logits[0])
    fed = [[] for _ in seqs]
    for step in range(STEPS):
        rows = [0, 1] if step < SHORT_STEPS else [0, 1, 2]
        for i in rows:
            token = (forced[i][len(fed[i])] if forced else int(np.argmax(last[i])))
            fed[i].append(token)
            seqs[i].token_ids.append(token)
        out = engine.decode([seqs[i] for i in rows])
        for i, row in zip(rows, out):
            last[i] = row
        logits.append(list(out))
    for seq in seqs:
        engine.free(seq)
    return [np.stack(call) for call in logits], fed


@pytest.fixture(scope="module")
def one_pass(tiny, work):
    """The one-pass artifacts' logits and greedy tokens, by family."""
    return {f: logits_of_every_call(export(tiny, work, f, "one-pass", **ONE_PASS))
            for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_key_blocks_equal_one_pass(tiny, work, one_pass, family):
    art = export(tiny, work, family, "blocks", **KEY_BLOCKS)
    loaded = load_artifact(art)
    body = loaded.body_text(loaded.entries["decode_b4_c64"])
    assert "stablehlo.while" in body and "stablehlo.case" in body, \
        "the decode entry loops over key blocks of the size it chooses"
    assert "stablehlo.case" not in loaded.body_text(loaded.entries["decode_b1_c64"]), \
        "a one-row entry has one key block: no many-rows block to choose"
    want, want_fed = one_pass[family]
    got, fed = logits_of_every_call(art, forced=want_fed)
    errors = [logits_error(g, w) for g, w in zip(got, want)]
    print(f"{family}: largest logits error over {len(errors)} calls {max(errors):.2e}")
    assert max(errors) <= TOL
    # the greedy ids: every row's argmax after every call
    assert [list(np.argmax(g, axis=-1)) for g in got] == [list(np.argmax(w, axis=-1))
                                                           for w in want]
    assert fed == want_fed


def test_one_block_short_fails_the_tolerance(tiny, work, one_pass, monkeypatch):
    """Negative control: the loop stops one block before the block holding the call's last
    live position (its keys masked), for llama; the error is far above the tolerance."""
    import jax.numpy as jnp

    blockwise = attention.blockwise

    def one_block_short(q, k_pool, v_pool, tables, positions, seq_lens, key_block, *rest):
        last = jnp.max(seq_lens) - 1
        return blockwise(q, k_pool, v_pool, tables, positions,
                         jnp.minimum(seq_lens, last // key_block * key_block), key_block, *rest)

    monkeypatch.setattr(attention, "blockwise", one_block_short)
    art = export(tiny, work, "llama", "one-block-short", **KEY_BLOCKS)
    monkeypatch.undo()
    want, want_fed = one_pass["llama"]
    got, _ = logits_of_every_call(art, forced=want_fed)
    err = max(logits_error(g, w) for g, w in zip(got, want))
    print(f"llama, one block short: logits error {err:.2e}")
    assert err > 100 * TOL

"""Attention that follows the sequence, per family: decode and prefill entries whose context
spans several key blocks loop over the blocks their rows hold (export/attention.py
`blockwise`) and give the one-pass form's greedy ids and logits, through the engine, with rows
at and one past block boundaries and a padding row in every decode call. Negative control: the
loop one block short fails the tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import logits_error

from triton_tlaloc.engine import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.export import layers
from triton_tlaloc.manifest import load_artifact
from triton_tlaloc.runtime import Runtime

TOL = 1e-5  # of the largest logit, f32: the same products summed in another order
# One context of 8 key blocks of 8 positions (one page each); prompts go in chunks of 16, so
# prefill calls cross blocks too. Batch 4: three sequences decode with one padding row.
OPTS = dict(batch_ladder=(1, 4), context_ladder=(64,), block_size=8, prefill_chunk=16)
ONE_PASS = dict(attention_block=64, decode_attention_block=64)
KEY_BLOCKS = dict(attention_block=8, decode_attention_block=8)
# Prompts ending one before, at and past block boundaries; the decode steps carry the three
# rows over several more (lengths 15..39, 16..40, 33..57).
PROMPTS = [[(i * 37 + 11 + 5 * n) % 200 + 10 for i in range(length)]
           for n, length in enumerate((15, 16, 33))]
STEPS = 24
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
    """Each prompt prefilled alone, then the three decoded together for STEPS steps; the rows'
    logits after every call, and the tokens fed (the greedy ones, or `forced`)."""
    engine = Engine(Runtime(art))
    seqs = [engine.new_sequence(p) for p in PROMPTS]
    logits = [np.stack([engine.prefill_chunked(s)[0] for s in seqs])]
    fed = [[] for _ in seqs]
    for step in range(STEPS):
        for i, seq in enumerate(seqs):
            token = forced[i][step] if forced else int(np.argmax(logits[-1][i]))
            fed[i].append(token)
            seq.token_ids.append(token)
        logits.append(engine.decode(seqs))
    for seq in seqs:
        engine.free(seq)
    return logits, fed


@pytest.fixture(scope="module")
def one_pass(tiny, work):
    """The one-pass artifacts' logits and greedy tokens, by family."""
    return {f: logits_of_every_call(export(tiny, work, f, "one-pass", **ONE_PASS))
            for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_key_blocks_equal_one_pass(tiny, work, one_pass, family):
    art = export(tiny, work, family, "blocks", **KEY_BLOCKS)
    body = load_artifact(art).body_text(load_artifact(art).entries["decode_b4_c64"])
    assert "stablehlo.while" in body and "dynamic_slice" in body, \
        "the decode entry loops over key blocks"
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

    blockwise = layers.blockwise

    def one_block_short(q, k_pool, v_pool, tables, positions, seq_lens, key_block, *rest):
        last = jnp.max(seq_lens) - 1
        return blockwise(q, k_pool, v_pool, tables, positions,
                         jnp.minimum(seq_lens, last // key_block * key_block), key_block, *rest)

    monkeypatch.setattr(layers, "blockwise", one_block_short)
    art = export(tiny, work, "llama", "one-block-short", **KEY_BLOCKS)
    monkeypatch.undo()
    want, want_fed = one_pass["llama"]
    got, _ = logits_of_every_call(art, forced=want_fed)
    err = max(logits_error(g, w) for g, w in zip(got, want))
    print(f"llama, one block short: logits error {err:.2e}")
    assert err > 100 * TOL

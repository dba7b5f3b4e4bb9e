"""The windowed KV pool (tlaloc-serving-v3): sliding layers keep a ring of pages per sequence.
The windowed model equals the same model with full-history pages sent the same calls, and
transformers; a ring one page short, or a call one token longer than the ring holds, does not."""

from __future__ import annotations

import numpy as np
import pytest
from checks.oracle import load_reference, logits_error, reference_greedy

from triton_tlaloc.batcher import Batcher, Request
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.scheduling.policy import BatchPolicy

# Window 8, pages of 4, prefill calls of 8: rings of ceil((8 - 1 + 8) / 4) = 4 pages.
OPTS = dict(batch_ladder=(1, 2), context_ladder=(32, 64), block_size=4, prefill_chunk=8,
            attention_block=16)
PROMPT = [(i * 53 + 7) % 240 + 10 for i in range(30)]  # nearly four windows
STEPS = 16
TOL = 1e-5  # windowed against full-history: the same sums over other key sets (masked ones)


@pytest.fixture(scope="module")
def models(tiny, work):
    out = {}
    for family in ("mistral", "gemma3_text"):
        ckpt = tiny.window_checkpoint(family)
        out[family] = {
            "ckpt": ckpt,
            "windowed": export_artifact(ckpt, work / f"art-{family}-windowed",
                                        ExportOptions(**OPTS)),
            "full": export_artifact(ckpt, work / f"art-{family}-fullhistory",
                                    ExportOptions(**OPTS, windowed_kv=False)),
        }
    return out


def stepwise_logits(art, prompt=PROMPT, steps=STEPS, chunks=None):
    """Every call's logits: the prompt in `chunks` (default: the runtime's own split), then
    greedy decode. Returns (list of logits, ids, engine, sequence left held)."""
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    out = []
    if chunks is None:
        out.append(engine.prefill_chunked(seq)[0])
    else:
        for n in chunks:
            entry = engine.entry_for("prefill", 1, seq.num_cached + n, n)
            out.append(engine._call(entry, [seq], [seq.uncached[:n]])[0])
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(out[-1])))
        seq.token_ids.append(ids[-1])
        out.append(engine.decode([seq])[0])
    return out, ids, engine, seq


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_windowed_equals_full_history_and_transformers(models, family):
    m = models[family]
    art = load_artifact(m["windowed"])
    assert art.schema == "tlaloc-serving-v3" and art.windowed.ring_pages == 4
    assert load_artifact(m["full"]).schema == "tlaloc-serving-v2"
    win, ids_win, engine, seq = stepwise_logits(m["windowed"])
    full, ids_full, *_ = stepwise_logits(m["full"])
    worst = max(logits_error(a, b) for a, b in zip(win, full))
    print(f"{family}: windowed against full-history, worst {worst:.2e} over {len(win)} calls")
    assert worst <= TOL
    want, want_logits = reference_greedy(load_reference(m["ckpt"]), PROMPT, STEPS)
    assert ids_win == ids_full == want
    assert logits_error(win[0], want_logits) <= 1e-4
    # chunked through the rings against the whole prompt in one call with full-history pages
    whole = export_artifact(m["ckpt"], m["full"].parent / f"art-{family}-whole",
                            ExportOptions(**{**OPTS, "prefill_chunk": None}, windowed_kv=False))
    one_call, ids_whole, *_ = stepwise_logits(whole, steps=STEPS)
    assert logits_error(win[0], one_call[0]) <= TOL and ids_whole == ids_win
    # the ring never grows past its pages while the full-history pages grow with the sequence
    assert len(seq.ring) == 4
    if family == "gemma3_text":
        assert len(seq.pages) == -(-len(seq.token_ids) // 4)
    else:
        assert seq.pages == [], "mistral: every layer is windowed, no full-history pages"


def test_a_long_prompt_through_the_batcher_equals_the_engine(models):
    """The backend admits a whole prompt (its ring reserved up front) and runs it in calls the
    ring can hold; each call's ring is the part its blocks reach."""
    art = models["gemma3_text"]["windowed"]
    rt = Runtime(art)
    batcher = Batcher(Engine(rt), BatchPolicy(cohort_wait_s=0.0, prefill_wait_s=0.0))
    got = []
    batcher.submit(Request("s", PROMPT, True, False, got.append))
    batcher.run_pending()
    want, *_ = stepwise_logits(art, steps=0)
    assert got[0].error is None, got[0].error
    assert logits_error(got[0].logits, want[0]) <= TOL
    assert got[0].kv_pages == (8, 4)


def test_kv_pages_through_the_batcher(models):
    """KV_PAGES: the windowed pages stay at most ringPages as the full pages grow."""
    rt = Runtime(models["gemma3_text"]["windowed"])
    batcher = Batcher(Engine(rt), BatchPolicy(cohort_wait_s=0.0, prefill_wait_s=0.0))
    seen = []

    def reply(r):
        seen.append(r)
    batcher.submit(Request("s", PROMPT[:6], True, False, reply))
    batcher.run_pending()
    for _ in range(40):
        batcher.submit(Request("s", [int(np.argmax(seen[-1].logits))], False, False, reply))
        batcher.run_pending()
    pages = [r.kv_pages for r in seen]
    assert pages[0] == (2, 2) and pages[-1] == (12, 4)
    assert max(w for _, w in pages) == 4 and [f for f, _ in pages] == sorted(f for f, _ in pages)


def test_a_ring_one_page_short_changes_the_logits(models, work):
    """Negative control: the same 8-token calls through rings of 3 pages instead of 4."""
    m = models["gemma3_text"]
    short = export_artifact(m["ckpt"], work / "art-gemma3-ring-short",
                            ExportOptions(**OPTS, ring_pages=3))
    chunks = [8, 8, 8, 6]
    good, *_ = stepwise_logits(m["windowed"], steps=2, chunks=chunks)
    bad, *_ = stepwise_logits(short, steps=2, chunks=chunks)
    worst = max(logits_error(a, b) for a, b in zip(good, bad))
    print(f"a ring one page short: worst {worst:.2e}")
    assert worst > 100 * TOL


def test_a_call_one_token_longer_than_the_ring_holds_changes_the_logits(models, work):
    """Negative control: entries taking 12 tokens, rings of 4 pages (16 positions). From
    position 8 a call may write 16 - 7 = 9 tokens; a call of 10 overwrites keys its own first
    tokens still need."""
    ckpt = models["gemma3_text"]["ckpt"]
    opts = {**OPTS, "prefill_chunk": 12}
    ring = export_artifact(ckpt, work / "art-gemma3-chunk12-ring4",
                           ExportOptions(**opts, ring_pages=4))
    full = export_artifact(ckpt, work / "art-gemma3-chunk12-full",
                           ExportOptions(**opts, windowed_kv=False))
    from triton_tlaloc.engine.core import Sequence
    assert Engine(Runtime(ring)).max_call_tokens(Sequence(PROMPT[:8], num_cached=8)) == 9
    ok = logits_error(stepwise_logits(ring, steps=0, chunks=[8, 9])[0][-1],
                      stepwise_logits(full, steps=0, chunks=[8, 9])[0][-1])
    over = logits_error(stepwise_logits(ring, steps=0, chunks=[8, 10])[0][-1],
                        stepwise_logits(full, steps=0, chunks=[8, 10])[0][-1])
    print(f"9 tokens from position 8: {ok:.2e}; 10 tokens: {over:.2e}")
    assert ok <= TOL
    assert over > 100 * TOL


def test_kv_bytes_per_sequence_from_the_manifest_match_the_pools(models):
    """The docs' table is computed from the manifest: check it against the allocated pools."""
    art = load_artifact(models["gemma3_text"]["windowed"])
    rt = Runtime(art, entries=["decode_b1_c32"])
    m, w = art.model, art.windowed
    page = m.block_size * m.kv_heads * m.head_size * 4 * 2  # K and V, f32
    full_layers = m.layers - len(w.layers)
    expect = page * (full_layers * m.num_blocks + len(w.layers) * w.num_blocks)
    assert rt.pool_bytes == expect

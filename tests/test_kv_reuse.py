"""KV reuse on real PJRT runtimes: a prompt that reuses cached blocks, or continues an ended
sequence whole, gives the same greedy ids as the same prompt computed cold, and its first logits
within 1e-5. Negative controls: block hashes that forget their parent serve the wrong KV and
fail the comparison; a continuation offered to a prompt that differs in one history token is
not taken. Pages reused whatever they hold: with every page a sequence can take filled with NaN
(what a sequence whose KV was NaN leaves in the pages it frees), prompts give the ids they give
over clean pools; control: an export whose masks weight the values without selecting them
fails it."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc import pages
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, attention, export_artifact
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.kv.sequence import Sequence

TOL = 1e-5  # reused KV against computed: the same values, summed in calls of other shapes
STEPS = 8


def tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 250, n)]


def first_logits(engine: Engine, prompt: list[int], salt=None):
    """The prompt's last-token logits and what it found cached; the sequence then ends (kept
    for a next turn, its blocks cached)."""
    seq = Sequence([])
    reuse = engine.admit(seq, prompt, salt)
    logits = engine.prefill_chunked(seq)[0]
    engine.finish(seq)
    return logits, reuse


def close(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def pair(art):
    """The same artifact twice: prefix reuse on, and off (the cold reference)."""
    return Engine(Runtime(art), prefix_reuse=True), Engine(Runtime(art))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def full_history(request, tiny):
    return pair(tiny.artifact(request.param, False))


def test_prompts_sharing_1_2_3_blocks_and_a_prompt_all_cached_equal_the_cold_run(full_history):
    on, off = full_history
    bs = on.block_size  # 8
    base = tokens(1, 4 * bs)
    first_logits(on, base + [7])  # caches blocks 0..3 of base
    cases = [(base[:bs] + tokens(2, 13), bs), (base[:2 * bs] + tokens(3, 5), 2 * bs),
             (base[:3 * bs] + tokens(4, 9), 3 * bs),
             # entirely cached: 4 blocks; the last block is computed again for its logits
             (base, 3 * bs)]
    for prompt, expect in cases:
        warm, reuse = first_logits(on, prompt)
        cold, none = first_logits(off, prompt)
        assert (reuse.reused, none.reused) == (expect, 0), (len(prompt), reuse)
        assert close(warm, cold) <= TOL, close(warm, cold)
        ids_on = on.generate_greedy(prompt, STEPS)
        ids_off = off.generate_greedy(prompt, STEPS)
        assert ids_on.reused_tokens >= expect
        assert ids_on.generated_ids == ids_off.generated_ids
    on.blocks.check([])
    assert on.blocks.usage()["full"][0] == 0, "no live sequence left holding pages"


def test_a_chat_continues_its_previous_turn_and_generates_the_same_ids(full_history):
    on, off = full_history
    history, fed = tokens(10, 11), 0
    for turn in range(4):
        history += tokens(20 + turn, 9)  # the user's new message
        warm = on.generate_greedy(history, STEPS)
        cold = off.generate_greedy(history, STEPS)
        assert warm.generated_ids == cold.generated_ids, turn
        # Everything fed last turn (its prompt and its answer but the last token) is kept.
        assert warm.reused_tokens == fed, (turn, warm.reused_tokens, fed)
        history += warm.generated_ids
        fed = len(history) - 1
    assert on.blocks.continued >= 3


def test_control_hashes_without_their_parent_serve_the_wrong_kv(tiny, monkeypatch):
    """Two prompts whose second blocks are equal but whose first blocks differ: with a block
    hash that forgets its parent, the second block of one prompt is attached to the other,
    although its KV was computed after another first block. The logits then differ from the
    cold run; with the chained hash they do not."""
    art = tiny.artifact("llama", False)
    bs = 8
    x, x2, y = tokens(30, bs), tokens(31, bs), tokens(32, bs)
    tail = tokens(33, 5)
    _, off = pair(art)
    cold, _ = first_logits(off, x2 + y + tail)

    def run(hash_fn):
        monkeypatch.setattr(pages, "block_hash", hash_fn)
        engine = Engine(Runtime(art), prefix_reuse=True)
        first_logits(engine, x + y + [1])  # caches x, then y after x
        first_logits(engine, x2 + [2])  # caches x2
        return first_logits(engine, x2 + y + tail)

    chained, reuse = run(pages.block_hash)
    assert reuse.reused == bs and close(chained, cold) <= TOL
    forgetful, reuse = run(lambda parent, toks, h=pages.block_hash: h(b"", toks))
    assert reuse.reused == 2 * bs, "y's page is attached after x2"
    assert close(forgetful, cold) > 100 * TOL, close(forgetful, cold)


def test_different_cache_salts_share_nothing(tiny):
    on, _ = pair(tiny.artifact("llama", False))
    prompt = tokens(40, 30)
    first_logits(on, prompt, salt="tenant-a")
    _, other = first_logits(on, prompt, salt="tenant-b")
    _, same = first_logits(on, prompt, salt="tenant-a")
    assert other.reused == 0 and same.reused > 0


@pytest.fixture(scope="module")
def windowed(tiny, work):
    # Window 8, pages of 4: rings of 4 pages (tests/test_windowed.py's shapes)
    opts = dict(batch_ladder=(1, 2), context_ladder=(32, 64), block_size=4, prefill_chunk=8,
                attention_block=16)
    arts = {family: export_artifact(tiny.window_checkpoint(family), work / f"reuse-{family}",
                                    ExportOptions(**opts))
            for family in ("mistral", "gemma3_text")}
    # gemma3_text with its windows as masks over full-history pages: prefix blocks apply
    arts["gemma3_text_full"] = export_artifact(tiny.window_checkpoint("gemma3_text"),
                                               work / "reuse-gemma3_text-full",
                                               ExportOptions(**opts, windowed_kv=False))
    return arts


def test_a_sliding_window_model_on_full_history_pages_reuses_prefix_blocks(windowed):
    on, off = pair(windowed["gemma3_text_full"])
    assert on.blocks.prefix_reuse
    base = tokens(90, 24)  # past the window of 8: the shared blocks hold KV the window masks
    first_logits(on, base + [3])
    for prompt in (base[:12] + tokens(91, 9), base + tokens(92, 5)):
        warm, reuse = first_logits(on, prompt)
        cold, _ = first_logits(off, prompt)
        assert reuse.reused > 0 and not reuse.continued
        assert close(warm, cold) <= TOL, close(warm, cold)
        assert (on.generate_greedy(prompt, STEPS).generated_ids
                == off.generate_greedy(prompt, STEPS).generated_ids)



@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_sliding_window_chat_continues_through_its_ring(windowed, family):
    on, off = pair(windowed[family])
    assert not on.blocks.prefix_reuse, "a ring cannot be rebuilt from shared blocks"
    history, fed = tokens(50, 13), 0
    for turn in range(3):
        history += tokens(60 + turn, 5)
        warm = on.generate_greedy(history, STEPS)
        cold = off.generate_greedy(history, STEPS)
        assert warm.generated_ids == cold.generated_ids, (family, turn)
        assert warm.reused_tokens == fed
        history += warm.generated_ids
        fed = len(history) - 1
    # control: one history token changed, the ended sequence is not taken over
    changed = list(history)
    changed[3] = (changed[3] + 1) % 240 + 10
    _, reuse = first_logits(on, changed + [5])
    assert reuse.reused == 0 and not reuse.continued


def test_a_hybrid_chat_continues_through_its_state_slot(tiny):
    art = tiny.artifact("qwen3_5_text", False, batch_ladder=(1, 2), context_ladder=(64, 256),
                        block_size=8)
    on, off = pair(art)
    history, fed = tokens(70, 20), 0
    logits_checked = False
    for turn in range(3):
        history += tokens(80 + turn, 7)
        if turn == 2:  # the first logits of a continued turn against a cold run
            warm_logits, reuse = first_logits(on, history)
            cold_logits, _ = first_logits(off, history)
            assert reuse.continued and close(warm_logits, cold_logits) <= TOL
            logits_checked = True
            break
        warm = on.generate_greedy(history, STEPS)
        cold = off.generate_greedy(history, STEPS)
        assert warm.generated_ids == cold.generated_ids, turn
        assert warm.reused_tokens == fed
        history += warm.generated_ids
        fed = len(history) - 1
    assert logits_checked


# ------------------------------------------------------------------ pages holding NaN

# Prompts in chunks of 24 over key blocks of 16 (blockwise), decode steps in one pass
# (tests/test_long_context.py's artifact).
STALE_OPTS = dict(prefill_chunk=24, attention_block=16)
# Prompts ending mid-page: 3 tokens (a page whose tail holds what its last holder left), 13,
# and 45 (two chunks, a context of 128).
STALE_PROMPTS = [tokens(100, 3), tokens(101, 13), tokens(102, 45)]


def nan_pages(rt: Runtime) -> None:
    """Every KV pool's pages but page 0 (which no sequence is given) set to NaN on the device,
    as a sequence whose KV was NaN leaves the pages it frees for the next ones."""
    for pool in rt.artifact.pools:
        values = rt.pool_snapshot(pool.name)
        values[1:] = np.nan
        rt.pools[pool.name] = rt.device.put(values)


def ids_over_nan_pages(art, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's greedy ids over clean pools, then with every page NaN (no prefix reuse:
    each prompt takes pages as a cold START does)."""
    engine = Engine(Runtime(art))
    clean = [engine.generate_greedy(p, STEPS).generated_ids for p in prompts]
    nan_pages(engine.rt)
    return clean, [engine.generate_greedy(p, STEPS).generated_ids for p in prompts]


def test_pages_an_earlier_sequence_left_nan_change_no_later_ids(tiny):
    clean, over_nan = ids_over_nan_pages(tiny.artifact("llama", False, **STALE_OPTS),
                                         STALE_PROMPTS)
    assert over_nan == clean


def test_control_values_weighted_by_the_mask_alone_give_nan_ids(tiny, work, monkeypatch):
    """The old masking (a zero softmax weight times a value the row does not hold): the NaN
    past a prompt's length reaches its result. One prompt, in the smallest export that runs
    it."""
    monkeypatch.setattr(attention, "held_values", lambda values, held: values.astype(np.float32))
    art = export_artifact(tiny.checkpoint("llama", False), work / "stale-multiplied",
                          ExportOptions(batch_ladder=(1,), context_ladder=(32,), block_size=8,
                                        prefill_tokens=(), **STALE_OPTS))
    monkeypatch.undo()
    clean, over_nan = ids_over_nan_pages(art, STALE_PROMPTS[1:2])
    assert over_nan != clean

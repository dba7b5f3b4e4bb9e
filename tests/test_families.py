"""Sliding-window families against transformers: mistral (a window on every layer) and
gemma3_text (sliding and full layers, q/k norm, GELU-tanh, sandwich norms, embedding scale, RoPE
per layer type, query_pre_attn_scalar). Windows are masks over full-history pages here."""

from __future__ import annotations

import json
import shutil

import pytest
from checks.oracle import load_reference, logits_error, reference_greedy

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.runtime.core import Runtime

PROMPT = [(i * 53 + 7) % 240 + 10 for i in range(30)]  # three windows of 8 and more
STEPS = 16
TOL = 1e-4  # of the largest logit, f32
OPTS = dict(batch_ladder=(1, 2), context_ladder=(32, 64), block_size=4)


@pytest.fixture(scope="module")
def checkpoints(tiny):
    return {family: tiny.window_checkpoint(family) for family in ("mistral", "gemma3_text")}


def run(art, prompt=PROMPT):
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    first = engine.prefill_chunked(seq)[0]
    engine.free(seq)
    return first, engine.generate_greedy(prompt, STEPS).generated_ids


VARIANTS = {"one pass, whole prompt": {}, "blockwise, chunks of 8": {"attention_block": 16,
                                                                     "prefill_chunk": 8}}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_greedy_ids_and_logits_match_transformers(checkpoints, work, family, variant):
    ckpt = checkpoints[family]
    name = "-".join(f"{k}{v}" for k, v in variant.items()) or "plain"
    art = export_artifact(ckpt, work / f"art-{family}-{name}", ExportOptions(**OPTS, **variant))
    want_ids, want_logits = reference_greedy(load_reference(ckpt), PROMPT, STEPS)
    logits, ids = run(art)
    err = logits_error(logits, want_logits)
    print(f"{family} {name}: logits error {err:.2e}")
    assert ids == want_ids
    assert err <= TOL


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_without_the_window_the_check_fails(checkpoints, work, family):
    """Negative control: the same weights with the sliding window removed from the config."""
    ckpt = checkpoints[family]
    bad = work / f"ckpt-{family}-no-window"
    if not bad.exists():
        shutil.copytree(ckpt, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["sliding_window"] = None
        if "layer_types" in cfg and cfg["layer_types"]:
            cfg["layer_types"] = ["full_attention"] * len(cfg["layer_types"])
        (bad / "config.json").write_text(json.dumps(cfg))
    art = export_artifact(bad, work / f"art-{family}-no-window", ExportOptions(**OPTS))
    want_ids, want_logits = reference_greedy(load_reference(ckpt), PROMPT, STEPS)
    logits, ids = run(art)
    err = logits_error(logits, want_logits)
    print(f"{family} without its window: logits error {err:.2e}")
    assert err > TOL

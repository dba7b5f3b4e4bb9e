"""An artifact under vLLM (triton_tlaloc/vllm_plugin, VLLM_PLUGINS=tlaloc): `LLM(model=ARTIFACT,
block_size=16, max_model_len=256)` gives transformers' greedy ids for tiny llama and qwen3
artifacts (16 tokens, alone and 4 prompts at once), vLLM's scheduler and block manager deciding
every call: its prefix cache finds a shared 200-token prefix and the ids stay the same; a block
size or a length the artifact was not exported for, and rings (v3) or state slots (v4), are
refused by name at start."""

from __future__ import annotations

import pytest

# (vllm.entrypoints: where vLLM is absent, this folder is found as a namespace package "vllm")
pytest.importorskip("vllm.entrypoints",
                    reason="the vLLM lane: make test-vllm runs these in .venv-vllm")

from checks.oracle import load_reference, reference_greedy  # noqa: E402
from vllm_lane import exported_fixture, vllm_run  # noqa: E402

# (a fixture here, not in a conftest.py of this folder: a second module named conftest would
# shadow tests/conftest.py for the tests that import from it)
exported = pytest.fixture(scope="session")(exported_fixture)

STEPS = 16
PROMPTS = [[1, 17, 99, 3, 200, 41, 7, 88, 5, 60], [(i * 37 + 11) % 250 + 3 for i in range(70)],
           [5, 9, 200, 31], [(i * 13 + 5) % 240 + 4 for i in range(33)]]


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3", True)])
def test_greedy_ids_equal_transformers_alone_and_together(tiny, exported, family, tied):
    ckpt = tiny.checkpoint(family, tied)
    art = exported(ckpt, f"{family}-{tied}")
    model = load_reference(ckpt)
    want = [reference_greedy(model, p, STEPS)[0] for p in PROMPTS]
    alone = vllm_run(art, PROMPTS[:2])
    assert alone["ids"] == want[:2]
    together = vllm_run(art, PROMPTS, together=True)
    assert together["ids"] == want
    # 4 prompts at once: fewer calls than one prompt at a time would make (decode rows batched)
    assert together["calls"] < 4 * STEPS


def test_vllms_prefix_cache_finds_a_shared_prefix_and_the_ids_stay(tiny, exported):
    ckpt = tiny.checkpoint("llama", False)
    art = exported(ckpt, "llama-False")
    prefix = [(i * 29 + 7) % 250 + 3 for i in range(200)]
    prompts = [prefix + [11, 12, 13], prefix + [40, 41]]
    model = load_reference(ckpt)
    want = [reference_greedy(model, p, STEPS)[0] for p in prompts]
    cached = vllm_run(art, prompts, enable_prefix_caching=True)
    assert cached["ids"] == want
    assert cached["cached"] == [0, 192]  # the second: 12 full blocks of 16 found
    plain = vllm_run(art, prompts, enable_prefix_caching=False)
    assert plain["ids"] == want and plain["cached"] == [0, 0]  # control


def test_what_the_artifact_was_not_exported_for_is_refused_by_name(tiny, exported):
    art = exported(tiny.checkpoint("llama", False), "llama-False")
    wrong = vllm_run(art, PROMPTS[:1], block_size=32)
    assert "block size 32: the artifact's pages hold 16 tokens (--block-size 16)" in wrong["error"]
    off = vllm_run(art, PROMPTS[:1], max_model_len=200)
    assert "max model length 200 is not on the artifact's context ladder [256]" in off["error"]
    rings = exported(tiny.window_checkpoint("gemma3_text"), "gemma3_text")
    assert "sliding-window rings" in vllm_run(rings, PROMPTS[:1])["error"]
    state = exported(tiny.checkpoint("qwen3_5_text", False), "qwen3_5_text")
    assert "linear-attention state slots" in vllm_run(state, PROMPTS[:1])["error"]


def test_smollm2_gives_transformers_ids_alone_and_together(exported, run_dir):
    from vllm_lane import smollm2_sources

    gguf, hf = smollm2_sources(run_dir)
    art = exported(gguf, "smollm2")
    model = load_reference(hf)
    prompts = [[(i * 977 + 13 * k) % 49000 + 100 for i in range(12 + 9 * k)] for k in range(4)]
    want = [reference_greedy(model, p, STEPS)[0] for p in prompts]
    assert vllm_run(art, prompts[:1])["ids"] == want[:1]
    assert vllm_run(art, prompts, together=True)["ids"] == want

"""Sampling under vLLM (VLLM_PLUGINS=tlaloc): the worker draws each step's tokens with vLLM's own
Sampler from the artifact's logits (triton_tlaloc/vllm_plugin/sampling.py). Four requests at
once on the tiny llama, greedy and sampled side by side: seeded requests (temperature and top-p
and top-k; temperature alone) give the ids vLLM's Sampler draws, one row at a time with the
same seed, from transformers' logits, and a greedy request under presence, frequency and
repetition penalties the Sampler's penalized argmax (no token twice); a plain greedy request
keeps transformers' greedy ids and its logprobs are transformers' log-softmax within 1e-4, its
top 3 transformers' top 3. Controls: another seed gives other ids; plain greedy repeats
tokens."""

from __future__ import annotations

import pytest

# (vllm.entrypoints: where vLLM is absent, this folder is found as a namespace package "vllm")
pytest.importorskip("vllm.entrypoints",
                    reason="the vLLM lane: make test-vllm runs these in .venv-vllm")

from checks.oracle import load_reference, reference_greedy  # noqa: E402
from vllm_lane import exported_fixture, vllm_run  # noqa: E402

exported = pytest.fixture(scope="session")(exported_fixture)

STEPS = 16
PROMPTS = [[1, 17, 99, 3, 200, 41, 7, 88, 5, 60], [(i * 37 + 11) % 250 + 3 for i in range(70)],
           [5, 9, 200, 31], [(i * 13 + 5) % 240 + 4 for i in range(33)]]
TOP = dict(temperature=0.8, top_p=0.9, top_k=40, seed=7)
# greedy under penalties (the tiny model's logits lie close together: penalties large enough
# to matter there keep it from choosing any token twice, where plain greedy repeats)
PENALIZED = dict(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0,
                 repetition_penalty=1.5)
SAMPLING = [dict(logprobs=3), TOP, PENALIZED, dict(temperature=0.7, seed=5)]


def logits_after(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1:].float()


def samplers_ids(model, prompt, steps, params) -> list[int]:
    """vLLM's Sampler, one row a step over transformers' logits, its generator seeded as vLLM
    seeds a request's (temperature 0: greedy, after the penalties)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    greedy = params["temperature"] == 0.0
    gens = {} if greedy else {0: torch.Generator().manual_seed(params["seed"])}
    pen = [params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0),
           params.get("repetition_penalty", 1.0)]
    penalized = pen != [0.0, 0.0, 1.0]
    sampler, ids = Sampler(), []
    for _ in range(steps):
        logits = logits_after(model, prompt + ids)
        vocab = logits.shape[1]
        meta = SamplingMetadata(
            temperature=torch.tensor([params["temperature"]]), all_greedy=greedy,
            all_random=not greedy,
            top_p=torch.tensor([params["top_p"]]) if "top_p" in params else None,
            top_k=(torch.tensor([params["top_k"]], dtype=torch.int32) if "top_k" in params
                   else None),
            generators=gens, max_num_logprobs=None, no_penalties=not penalized,
            prompt_token_ids=torch.tensor([prompt]) if penalized else None,
            presence_penalties=torch.tensor(pen[:1]), frequency_penalties=torch.tensor(pen[1:2]),
            repetition_penalties=torch.tensor(pen[2:]),
            output_token_ids=[list(ids)] if penalized else [],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
        assert vocab > 2
        ids.append(int(sampler(logits, meta).sampled_token_ids[0, 0]))
    return ids


def test_greedy_and_seeded_requests_at_once_give_vllms_sampler_over_transformers_logits(
        tiny, exported):
    import torch

    ckpt = tiny.checkpoint("llama", False)
    art = exported(ckpt, "llama-False")
    model = load_reference(ckpt)
    got = vllm_run(art, PROMPTS, STEPS, together=True, sampling=SAMPLING)
    greedy, _ = reference_greedy(model, PROMPTS[0], STEPS)
    assert got["ids"][0] == greedy
    for prompt, params, ids in zip(PROMPTS[1:], SAMPLING[1:], got["ids"][1:]):
        assert ids == samplers_ids(model, prompt, STEPS, params), params
    # controls: another seed; the penalties left out
    assert got["ids"][1] != samplers_ids(model, PROMPTS[1], STEPS, {**TOP, "seed": 8})
    plain, _ = reference_greedy(model, PROMPTS[2], STEPS)
    assert len(set(got["ids"][2])) == STEPS and len(set(plain)) < STEPS, (got["ids"][2], plain)
    assert got["logprobs"][1] is None
    # the greedy request's logprobs: its token's and the top 3, transformers' log-softmax
    for i, step in enumerate(got["logprobs"][0]):
        want = torch.log_softmax(logits_after(model, PROMPTS[0] + greedy[:i]).double(), -1)[0]
        top = torch.topk(want, 3).indices.tolist()
        assert {t for t, _ in step} == {greedy[i], *top}, (i, step, top)
        for t, lp in step:
            assert abs(lp - float(want[t])) <= 1e-4, (i, t, lp, float(want[t]))



def masked_greedy(model, prompt, steps, allowed=None, bias=None, banned_for=0):
    """Greedy over transformers' logits: only `allowed` tokens, `bias` added, and the tokens
    `bias` names banned for the first `banned_for` steps (min_tokens' stop tokens)."""
    import torch

    ids = []
    for i in range(steps):
        z = logits_after(model, prompt + ids)[0]
        if allowed is not None:
            keep = torch.full_like(z, float("-inf"))
            keep[allowed] = 0.0
            z = z + keep
        for t, b in (bias or {}).items():
            z[t] = float("-inf") if i < banned_for else z[t] + b
        ids.append(int(z.argmax()))
    return ids


def test_logit_bias_allowed_tokens_min_tokens_and_min_p_at_once(tiny, exported):
    """vLLM's logits processors and masks, four requests at once: a logit bias of +100 on a
    token makes greedy choose it every step; allowed_token_ids keep greedy to transformers'
    argmax over those five; min_tokens 5 with a stop token biased to the top holds it back for
    five tokens, then it ends the request; min_p 1.0 leaves a seeded temperature-1 draw only the
    most likely token, transformers' greedy ids. Control: the plain greedy ids are none of
    these."""
    ckpt = tiny.checkpoint("llama", False)
    art = exported(ckpt, "llama-False")
    model = load_reference(ckpt)
    allowed = [3, 50, 77, 140, 201]
    sampling = [dict(logit_bias={"42": 100.0}), dict(allowed_token_ids=allowed),
                dict(logit_bias={"99": 100.0}, stop_token_ids=[99], min_tokens=5),
                dict(temperature=1.0, seed=3, min_p=1.0)]
    got = vllm_run(art, PROMPTS, STEPS, together=True, sampling=sampling)["ids"]
    assert got[0] == [42] * STEPS
    assert got[1] == masked_greedy(model, PROMPTS[1], STEPS, allowed=allowed)
    held = masked_greedy(model, PROMPTS[2], 6, bias={99: 100.0}, banned_for=5)
    assert held[-1] == 99 and 99 not in held[:5] and got[2] == held
    assert got[3] == reference_greedy(model, PROMPTS[3], STEPS)[0]
    for i in range(3):  # control
        assert got[i] != reference_greedy(model, PROMPTS[i], STEPS)[0][:len(got[i])]


def test_prompt_logprobs_are_transformers_log_softmax_at_every_prompt_position(tiny, exported):
    """prompt_logprobs 2 on a prompt of 10 and one of 70 tokens, vLLM cutting the steps at 32
    tokens (so the long prompt comes in chunks, each run by the worker in verify calls): each
    prompt token after the first has transformers' log-probability within 1e-4, with
    transformers' top 2 beside it. Control: the log-softmax one position late is off by more.
    The generated ids stay transformers' greedy ids."""
    import torch

    ckpt = tiny.checkpoint("llama", False)
    art = exported(ckpt, "llama-False")
    model = load_reference(ckpt)
    prompts = PROMPTS[:2]
    got = vllm_run(art, prompts, 4, together=True, max_num_batched_tokens=32,
                   sampling=[dict(prompt_logprobs=2)] * 2)
    for prompt, ids, scored in zip(prompts, got["ids"], got["prompt_logprobs"]):
        assert ids == reference_greedy(model, prompt, 4)[0]
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
        assert scored[0] is None and len(scored) == len(prompt)
        late = 0.0
        for p in range(1, len(prompt)):
            step = dict(map(tuple, scored[p]))
            top = torch.topk(want[p - 1], 2).indices.tolist()
            assert set(step) == {prompt[p], *top}, (p, step, top)
            for t, lp in step.items():
                assert abs(lp - float(want[p - 1, t])) <= 1e-4, (p, t, lp)
            late = max(late, abs(step[prompt[p]] - float(want[p, prompt[p]])))
        assert late > 1e-3  # control

"""Sampling controls (generation/penalties.py, sampling.py's min_p): presence, frequency and
repetition penalties, logit_bias and min_tokens against a reference written from vLLM's
definitions token by token (controls: two wrong readings of them fail the same check); min_p's
cut against the softmax; every bad value refused by name; and a penalized generation keeping
its ids beside plain ones in a real batcher over the simulated runtime."""

from __future__ import annotations

import re

import numpy as np
import pytest

from checks.fakes import fake_artifact
from checks.schemas import generate_batched

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.generation.local_generation import Generation, Speculation
from triton_tlaloc.generation.penalties import LogitsAdjuster
from triton_tlaloc.generation.sampling import Sampler, SamplingError, SamplingParams
from triton_tlaloc.runtime.simulated import SimulatedRuntime

VOCAB = 64
PROMPT = [3, 5, 5, 9, 40]
OUTPUT = [5, 7, 7, 7, 12, 40, 2]
ENDS = {2, 63}


def reference(logits, prompt, output, *, presence=0.0, frequency=0.0, repetition=1.0,
              bias=(), min_tokens=0, ends=()):
    """vLLM's definitions, one token at a time: logit_bias added, end ids refused while fewer
    than min_tokens were generated, then for each token in the prompt or the output the
    repetition penalty (divide a positive logit, multiply a negative one), then minus
    frequency times its count in the output and presence if it is in the output."""
    z = [float(x) for x in logits]
    for t, b in bias:
        z[t] += b
    if len(output) < min_tokens:
        for t in ends:
            z[t] = -np.inf
    for t in range(len(z)):
        if t in prompt or t in output:
            z[t] = z[t] / repetition if z[t] > 0 else z[t] * repetition
        count = output.count(t)
        z[t] -= frequency * count + (presence if count else 0.0)
    return np.array(z, np.float32)


def adjusted(logits, prompt, output, wrong: str = "", **kw):
    params = SamplingParams.from_dict(kw)
    adjuster = LogitsAdjuster(params, prompt, ENDS)
    if wrong == "repetition over the output only":
        adjuster = LogitsAdjuster(params, [], ENDS)
        adjuster.took(prompt)
        adjuster.counts = {}
        adjuster.prompt = np.unique(np.array(output))
    adjuster.took(output)
    z = adjuster.adjust(logits)
    if wrong == "presence per count":
        for t, c in adjuster.counts.items():
            z[t] -= kw.get("presence_penalty", 0.0) * (c - 1)
    return z


SETTINGS = [
    dict(presence_penalty=0.7),
    dict(frequency_penalty=0.4),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5),
    dict(logit_bias={"4": 100, "7": -30.5}, repetition_penalty=1.2),
    dict(min_tokens=9, max_tokens=20, frequency_penalty=0.2),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=repr)
def test_the_adjusted_logits_are_vllms_definitions(kw):
    rng = np.random.default_rng(0)
    for _ in range(5):
        logits = rng.standard_normal(VOCAB).astype(np.float32) * 3
        want = reference(logits, PROMPT, OUTPUT,
                         presence=kw.get("presence_penalty", 0.0),
                         frequency=kw.get("frequency_penalty", 0.0),
                         repetition=kw.get("repetition_penalty", 1.0),
                         bias=[(int(k), v) for k, v in kw.get("logit_bias", {}).items()],
                         min_tokens=kw.get("min_tokens", 0), ends=ENDS)
        got = adjusted(logits, PROMPT, OUTPUT, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wrong, kw", [
    ("repetition over the output only", dict(repetition_penalty=1.3)),
    ("presence per count", dict(presence_penalty=0.7)),
])
def test_a_wrong_reading_of_the_definitions_fails_the_same_check(wrong, kw):
    logits = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32) * 3
    want = reference(logits, PROMPT, OUTPUT, presence=kw.get("presence_penalty", 0.0),
                     repetition=kw.get("repetition_penalty", 1.0))
    assert not np.allclose(adjusted(logits, PROMPT, OUTPUT, wrong, **kw), want,
                           rtol=1e-6, atol=1e-6)


def test_min_tokens_holds_the_ends_back_until_that_many_came():
    params = SamplingParams.from_dict({"min_tokens": 3, "max_tokens": 8})
    sampler = Sampler(params, PROMPT, ENDS)
    logits = np.zeros(VOCAB, np.float32)
    logits[2] = 10.0  # the end id is the argmax
    chosen = []
    for _ in range(4):
        chosen.append(sampler.choose(logits))
        sampler.took(chosen[-1:])
    assert 2 not in chosen[:3] and chosen[3] == 2


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_most_likely():
    logits = np.random.default_rng(2).standard_normal(VOCAB).astype(np.float32) * 2
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (1.0, 1.0)):
        params = SamplingParams.from_dict({"min_p": min_p, "temperature": temperature})
        ids, weights = Sampler(params).distribution(logits)
        kept = np.arange(VOCAB) if ids is None else ids
        probs = np.exp(logits / temperature - (logits / temperature).max())
        want = np.flatnonzero(probs >= min_p * probs.max() * (1 - 1e-6))
        assert list(kept[weights > 0]) == list(want)


@pytest.mark.parametrize("d, says", [
    ({"presence_penalty": 2.5}, "presence_penalty 2.5: must be in [-2, 2]"),
    ({"frequency_penalty": "1"}, "frequency_penalty '1': expected a number"),
    ({"repetition_penalty": 0}, "repetition_penalty 0.0: must be in (0, 10]"),
    ({"min_p": 1.5}, "min_p 1.5: must be in [0, 1]"),
    ({"logit_bias": {"7": 101}}, "logit_bias[7] 101: must be in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias 'x': a key must be a token id"),
    ({"logit_bias": {"-3": 1}}, "logit_bias '-3': a key must be a token id in"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: 301 entries: at most 300"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens 20: more than max_tokens 10"),
    ({"min_tokens": -1}, "min_tokens -1"),
])
def test_every_bad_value_is_refused_by_name(d, says):
    with pytest.raises(SamplingError, match=re.escape(says)):
        SamplingParams.from_dict(d)


def test_a_logit_bias_id_outside_the_vocabulary_is_refused_when_the_generation_starts():
    params = SamplingParams.from_dict({"logit_bias": {str(VOCAB): 5}})
    with pytest.raises(SamplingError, match=f"token id {VOCAB} is outside the vocabulary of "
                                            f"{VOCAB} tokens"):
        Generation(1, [5], params, {2}, 64, lambda e: None, lambda r: None,
                   Speculation(vocab=VOCAB))
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_a_penalized_generation_keeps_its_ids_beside_plain_ones():
    """Greedy with every adjustment, alone and started together with two plain generations
    in shared calls of a real batcher: the same ids; without the adjustments, other ids (the
    control that they do something)."""
    art = fake_artifact(batch_ladder=(1, 4), context_ladder=(128,), vocab=VOCAB)

    def run(specs):
        return generate_batched(Engine(SimulatedRuntime(art, 0.0)), None, specs, 2)
    penalized = SamplingParams.from_dict({
        "max_tokens": 24, "ignore_eos": True, "repetition_penalty": 1.5,
        "frequency_penalty": 0.8, "presence_penalty": 0.3, "logit_bias": {"11": 4.0},
        "min_tokens": 5})
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = run([([7, 8, 9], penalized)])[0]
    together = run([([3, 4], plain), ([7, 8, 9], penalized), ([5], plain)])
    assert together[1] == alone and len(alone) == 24
    assert run([([7, 8, 9], plain)])[0] != alone


def test_a_verify_calls_positions_each_see_the_counts_after_the_drafts_before_them():
    """Row i of a verify call is adjusted as if drafts[:i] had come: the reference applied to
    the output so far plus those drafts; the adjuster's counts are left as they were."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((4, VOCAB)).astype(np.float32) * 3
    kw = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.2,
              min_tokens=9, max_tokens=20)
    params = SamplingParams.from_dict(kw)
    adjuster = LogitsAdjuster(params, PROMPT, ENDS)
    adjuster.took(OUTPUT)
    drafts = [7, 30, 7]
    got = adjuster.adjust_positions(rows, drafts)
    for i in range(4):
        want = reference(rows[i], PROMPT, OUTPUT + drafts[:i], presence=0.2, frequency=0.6,
                         repetition=1.4, min_tokens=9, ends=ENDS)
        np.testing.assert_allclose(got[i], want, rtol=1e-6)
    assert adjuster.generated == len(OUTPUT) and adjuster.counts[7] == OUTPUT.count(7)
    stale = np.stack([adjuster.adjust(r) for r in rows])  # the control: counts not advanced
    assert not np.allclose(stale[3], got[3])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_penalized_generation_keeps_its_ids_under_speculation(temperature):
    """Prompt lookup with every adjustment through a real batcher (verify calls): greedy gives
    the ids of the same generation without speculation; seeded sampling gives the same ids
    twice, and other ids without the adjustments (the control that they reach verify rows)."""
    art = fake_artifact(batch_ladder=(1, 4), context_ladder=(128,), vocab=VOCAB)

    verified = []

    def run(d):
        params = SamplingParams.from_dict({"max_tokens": 30, "ignore_eos": True,
                                           "temperature": temperature, "seed": 5, **d})
        runtime = SimulatedRuntime(art, 0.0)
        positions = runtime.run_positions
        runtime.run_positions = lambda *a: (verified.append(a[0]), positions(*a))[1]
        return generate_batched(Engine(runtime), None, [([7, 8, 9, 7, 8, 9, 7, 8], params)],
                                2)[0]
    adjust = {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "logit_bias": {"11": 2.0},
              "min_tokens": 4}
    spec = {"speculative": {"method": "prompt_lookup", "num_draft_tokens": 3}}
    with_spec = run({**adjust, **spec})
    assert verified, "no verify call ran"
    assert len(with_spec) == 30 and with_spec == run({**adjust, **spec})
    if temperature == 0:
        assert with_spec == run(adjust)
    assert run(spec) != with_spec

"""Speculation in the generate model's loop (generation/speculative.py,
generation/local_generation.py): the `speculative` parameter, the n-gram index, the adaptive draft
length, speculative sampling (a chi-square test against the distribution sampled without drafts,
which a biased rule fails), and generations that speculate, against a model whose greedy
continuation is known."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from checks.fakes import Harness, KnownModel, fake_artifact, run_generation
from scipy.stats import chisquare

from triton_tlaloc.scheduling.admission import Reply
from triton_tlaloc.generation.drafting import NgramIndex, prompt_lookup
from triton_tlaloc.generation.sampling import Sampler, SamplingError, SamplingParams
from triton_tlaloc.generation.speculative import (DRAFT_COST, DraftLength, SpeculativeParams,
                                                  Speculator, StepCost, sampled_acceptance)
from triton_tlaloc.generation.local_generation import Generation, Speculation
from triton_tlaloc.runtime.simulated import one_hot

SPECULATE = Speculation(most_drafts=8, refused=None)


def test_the_speculative_parameter_is_checked_by_name_and_round_trips():
    p = SamplingParams.from_dict({"speculative": {"num_draft_tokens": 6,
                                                  "prompt_lookup_max": 4}})
    assert p.speculative == SpeculativeParams("prompt_lookup", 6, 4, 1, True)
    assert SamplingParams.from_dict(dataclasses.asdict(p)) == p  # as the link sends it
    assert SamplingParams.from_dict({}).speculative is None
    for bad, says in (({"speculative": 3}, "expected a JSON object"),
                      ({"speculative": {"method": "medusa"}}, "speculative.method 'medusa'"),
                      ({"speculative": {"num_draft_tokens": 0}}, "num_draft_tokens 0"),
                      ({"speculative": {"num_draft_tokens": 65}}, "num_draft_tokens 65"),
                      ({"speculative": {"num_draft_tokens": 2.5}}, "expected an integer"),
                      ({"speculative": {"prompt_lookup_max": 2, "prompt_lookup_min": 3}},
                       "prompt_lookup_min 3"),
                      ({"speculative": {"adaptive": "yes"}}, "adaptive 'yes'"),
                      ({"speculative": {"k": 1}}, "unknown speculative parameter(s) k")):
        with pytest.raises(SamplingError, match=f"sampling parameter .*{says}".replace(
                "(", r"\(").replace(")", r"\)")):
            SamplingParams.from_dict(bad)


@pytest.mark.parametrize("seed", range(20))
def test_the_ngram_index_drafts_what_prompt_lookup_drafts(seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 6, 80).tolist()  # a small vocabulary: many repeats
    high, low = int(rng.integers(1, 5)), 1
    low = int(rng.integers(1, high + 1))
    index = NgramIndex(history[:10], high, low)
    for n in range(10, len(history)):
        for k in (1, 3, 8):
            assert index.lookup(k) == prompt_lookup(history[:n], k, high, low), (n, k)
        index.extend([history[n]])


def test_the_draft_length_falls_while_drafts_fail_and_comes_back():
    length = DraftLength(8)
    assert 0 < length() < 8  # the prior: some drafts, not the most
    for _ in range(10):
        length.observe(length() or 1, 0)
    assert length() == 0
    for _ in range(20):
        length.observe(max(length(), 1), max(length(), 1))
    assert length() == 8
    fixed = DraftLength(5, adaptive=False)
    for _ in range(10):
        fixed.observe(5, 0)
    assert fixed() == 5


def test_the_draft_length_follows_runs_of_right_drafts():
    """Text in runs: six steps whose drafts all stand, then six that miss at once, over and
    over. Inside a run the rule drafts the most, between runs none (a single estimate of the
    acceptance, about one half, would draft a middling length in both); at 0 drafts a right
    free check starts a run again."""
    length = DraftLength(8)
    for _ in range(10):
        for _ in range(6):
            k = max(length(), 1)
            length.observe(k, k)
        for _ in range(6):
            length.observe(1, 0)
    assert length() == 0  # after a miss
    length.observe(1, 1)  # the free check was right
    assert length() == 8
    length.observe(8, 8)
    assert length() == 8
    length.observe(8, 2)  # the run ended
    assert length() == 0


def test_the_draft_length_weighs_what_each_verify_entry_costs():
    """Costs as measured on 2 cores (a call of 7 tokens 1.85 steps, of 9 tokens 3.5): at 90%
    acceptance 6 drafts (7 tokens) yield the most for the time, not 8; at 60%, 4 (on the entry
    of 5 tokens, never 3 drafts: the same call); at 5%, none. Without measurements, DRAFT_COST
    a token. A measured cost is read again after StepCost.REFRESH lookups."""
    measured = {("decode", 1): 0.03, ("verify", 3): 0.049, ("verify", 5): 0.049,
                ("verify", 7): 0.0555, ("verify", 9): 0.105}
    cost = StepCost((3, 5, 7, 9), lambda kind, t: measured.get((kind, t)))
    assert cost(6) == pytest.approx(1.85) and cost(3) == cost(4)
    for a, want in ((0.9, 6), (0.6, 4), (0.05, 0)):
        length = DraftLength(8, cost=cost)
        length.stood, length.tried = [a * 1e6] * 2, [1e6] * 2
        assert length() == want, a
    assert StepCost((3, 5, 7, 9))(6) == pytest.approx(1 + DRAFT_COST * 6)
    measured[("verify", 7)] = 0.3
    for _ in range(StepCost.REFRESH):
        cost(6)
    assert cost(6) == pytest.approx(10.0)


# ------------------------------------------------------------------ speculative sampling

VOCAB = 8


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1.5, (n, VOCAB)).astype(np.float32)


def _probs(params: SamplingParams, row: np.ndarray) -> np.ndarray:
    ids, w = Sampler(params).distribution(row)
    p = np.zeros(VOCAB)
    p[np.arange(VOCAB) if ids is None else ids] = w
    return p / p.sum()


def _biased(sampler, rows, drafts):
    """A wrong rule: a draft stands with probability min(1, 2p)."""
    for i, d in enumerate(drafts):
        ids, w = sampler.distribution(rows[i])
        p = float(w[d] / w.sum()) if ids is None else float(
            w[list(ids).index(d)] / w.sum()) if d in ids else 0.0
        if sampler.rng.random() < min(1.0, 2 * p):
            continue
        return i, sampler.choose(rows[i])
    return len(drafts), sampler.choose(rows[len(drafts)])


@pytest.mark.parametrize("rule, should_pass", [(sampled_acceptance, True), (_biased, False)])
@pytest.mark.parametrize("settings", [{"temperature": 0.8},
                                      {"temperature": 1.3, "top_k": 5, "top_p": 0.9}])
def test_speculative_sampling_draws_what_sampling_without_drafts_draws(rule, should_pass,
                                                                       settings):
    """Drafts over fixed logits (the second most likely token, then the most likely): the
    first token's distribution, and the second's when the first draft stood, match the
    target's at each position (chi-square, p > 0.001 over 8,000 draws); the biased rule fails
    the same test (its p-values underflow to 0 from 5,000 draws: the test has power to spare)."""
    params = SamplingParams(seed=11, **settings)
    rows = _rows(1, 3)
    drafts = [int(np.argsort(rows[0])[-2]), int(np.argmax(rows[1]))]
    sampler = Sampler(params)
    first, second = np.zeros(VOCAB), np.zeros(VOCAB)
    for _ in range(8_000):
        m, following = rule(sampler, rows, drafts)
        tokens = drafts[:m] + [following]
        first[tokens[0]] += 1
        if m >= 1:
            second[tokens[1]] += 1
    pvalues = []
    for counts, row in ((first, rows[0]), (second, rows[1])):
        p = _probs(params, row)
        assert counts[p == 0].sum() == 0  # never a token top-k or top-p left out
        live = p > 0
        pvalues.append(chisquare(counts[live], p[live] * counts.sum()).pvalue)
    assert (min(pvalues) > 1e-3) == should_pass, pvalues


def test_a_verify_call_keeps_what_its_acceptor_keeps():
    """The engine asks a row's acceptor (sampled speculation) which drafts stand: the sequence
    is cut back to them, its pages and KV with it, and the acceptor's token follows them."""
    h = Harness(fake_artifact())
    h.step(1, list(range(1, 7)), start=True)
    seen = []

    def keep_one(rows, drafts):
        seen.append((rows.shape, drafts))
        return 1, 99

    reply = h.step(1, [7, 20, 21, 22, 23, 24], draft_tokens=5, acceptor=keep_one,
                   want_logits=False)
    assert reply.error is None and reply.accepted_ids == [20, 99] and reply.logits is None
    assert seen == [((6, 256), [20, 21, 22, 23, 24])]
    seq = h.batcher.sequences[1]
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 20] and seq.num_cached == 8
    assert len(seq.pages) == 1 and h.rt.kv_of(seq) == seq.token_ids


# ------------------------------------------------------------------ generations that speculate


VOCAB_BIG = 64


def generate(model: KnownModel, prompt, params, speculation=SPECULATE):
    return run_generation(model, prompt, params, speculation)


def repeating(n: int, period: int = 7) -> list[int]:
    return [10 + (i % period) for i in range(n)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["repeats", "random"])
def test_a_speculating_generation_emits_the_greedy_ids(k, kind):
    rng = np.random.default_rng(k)
    prompt = repeating(20)
    text = repeating(60)[6:] if kind == "repeats" else rng.integers(1, 60, 60).tolist()
    params = SamplingParams(max_tokens=50, speculative=SpeculativeParams(num_draft_tokens=k))
    model = KnownModel(prompt, text)
    ids, reason, gen = generate(model, prompt, params)
    assert ids == text[:50] and reason == "length"
    if kind == "repeats":  # the drafts are right: fewer calls than tokens
        assert model.accepted == model.drafted and model.calls <= 1 + -(-49 // (k + 1)) + 2
    else:
        assert model.calls >= 40  # wrong drafts save nothing


def test_the_adaptive_rule_stops_drafting_where_drafts_fail_and_fixed_does_not():
    """A continuation unlike its prompt (whose tokens recur, so lookups find a match): with
    the rule, the drafts sent stop early; without it, every step carries them."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 8, 40).tolist()
    text = rng.integers(1, 8, 200).tolist()
    sent = {}
    for adaptive in (True, False):
        model = KnownModel(prompt, text)
        params = SamplingParams(max_tokens=200, speculative=SpeculativeParams(
            num_draft_tokens=8, adaptive=adaptive))
        ids, _, gen = generate(model, prompt, params)
        assert ids == text
        sent[adaptive] = model.drafted
    assert sent[False] > 800 and sent[True] < 120, sent


def test_drafts_stop_short_of_max_tokens_and_the_largest_context():
    prompt = repeating(20)
    model = KnownModel(prompt, repeating(40)[6:])
    params = SamplingParams(max_tokens=6, speculative=SpeculativeParams(num_draft_tokens=8,
                                                                        adaptive=False))
    ids, reason, _ = generate(model, prompt, params)
    assert ids == repeating(40)[6:12] and reason == "length"
    assert model.fed <= 20 + 6  # never fed past what max_tokens needs
    events, queued = [], []
    gen = Generation(2, prompt, params, set(), 23, events.append, queued.extend, SPECULATE)
    gen.on_reply(Reply(logits=one_hot(np.array(16), VOCAB_BIG)))  # length 21 of 23
    assert queued[-1].draft_tokens <= 1  # 21 + token + 1 draft = 23


def test_speculation_is_refused_by_name_where_the_sequence_model_cannot_verify():
    params = SamplingParams(speculative=SpeculativeParams())
    why = "the artifact has no verify entries"
    with pytest.raises(SamplingError, match=f"speculative: {why}"):
        Generation(1, [1, 2], params, set(), 64, print, print, Speculation(0, why))
    Generation(1, [1, 2], SamplingParams(), set(), 64, print, print, Speculation(0, why))


def test_a_sampled_generation_hands_the_batcher_its_acceptor():
    prompt = repeating(20)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=8,
                            speculative=SpeculativeParams(num_draft_tokens=4, adaptive=False))
    events, queued = [], []
    gen = Generation(3, prompt, params, set(), 4096, events.append, queued.extend, SPECULATE)
    gen.on_reply(Reply(logits=one_hot(np.array(16), VOCAB_BIG) * 30))  # near-certain
    step = queued[-1]
    assert step.draft_tokens == 4 and step.tokens[1:] == [10, 11, 12, 13]
    rows = one_hot(np.array([10, 11, 40, 41, 42]), VOCAB_BIG) * 30  # near-certain
    m, following = step.acceptor(rows, step.tokens[1:])
    assert m == 2 and following == 40
    assert Speculator(params.speculative, prompt, 8).drafts(4) == [16, 10, 11, 12]


def test_what_a_sequence_model_can_verify_and_what_its_calls_cost():
    """Speculation.of an engine: the most drafts (its largest verify entry, 9 tokens), the cost
    of a step from its entries' measured call times, one row's (the smallest timed entry that
    holds it; a name that is no entry is passed over); a linear-attention model and one
    without verify entries refuse, saying why."""
    from checks.fakes import FakeRuntime

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.scheduling.observer import BatcherStats

    measured = BatcherStats()
    measured.entry_seconds.update({"decode_b2_c32": 0.03, "verify_b1_c32_t5": 0.04,
                                   "swap": 9.0})
    engine = Engine(FakeRuntime(fake_artifact()))
    spec = Speculation.of(engine, measured)
    assert spec.cost(4) == pytest.approx(0.04 / 0.03)  # batch 1 untimed: batch 2's decode
    measured.entry_seconds["decode_b1_c32"] = 0.01
    spec = Speculation.of(engine, measured)  # (a StepCost reads the times again every 256)
    assert (spec.most_drafts, spec.refused) == (8, None)
    assert spec.cost(4) == pytest.approx(0.04 / 0.01) and spec.cost(3) == spec.cost(4)
    assert spec.cost(8) == pytest.approx(1 + DRAFT_COST * 8)  # the 9-token entry: not timed
    for art, why in ((fake_artifact(state_slots=4), "linear-attention"),
                     (fake_artifact(verify_tokens=()), "no verify entries")):
        spec = Speculation.of(Engine(FakeRuntime(art)), measured)
        assert spec.most_drafts == 0 and why in spec.refused

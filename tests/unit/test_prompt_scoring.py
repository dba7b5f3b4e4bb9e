"""Prompt scoring (generation/logprobs.py PromptScoring) through a real batcher over the fake
runtime, beside chats: the prompt is fed in chunks of the largest verify entry's tokens, one
chunk a round, each chunk taking its share of the batcher's time (scheduling/policy.py), with
the same entries and ids as feeding it one token a decode step; a prompt longer than the
model's bound is refused by name, a 400 through `tlaloc openai`."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from checks.fakes import Harness, fake_artifact
from test_chat_messages import write_tokenizer

from triton_tlaloc.frontends.client import GenerateResult
from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer
from triton_tlaloc.generation.local_generation import PROMPT_LOGPROBS, Generation, Speculation
from triton_tlaloc.generation.sampling import SamplingError, SamplingParams
from triton_tlaloc.model_parameters import default_int
from triton_tlaloc.scheduling.admission import Request
from triton_tlaloc.scheduling.policy import BatchPolicy, Cohort, select
from triton_tlaloc.scheduling.round_plan import forced_rows_to_decode

# Each call's time on the fake clock, in the proportions SmolLM2 has on the CPU (a decode step
# 57 ms, a verify call of 9 tokens about 450 ms, a chat's prompt about 850 ms)
COST = {"decode": 0.05, "verify": 0.4, "prefill": 0.8}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(104)]


def serve(chats: int, speculation=None, scoring_flag: bool = True):
    """The prompt scored (prompt_logprobs 2, one token out) beside `chats` chats that decode
    all along; the batcher's rounds run on the test's thread over a clock each call advances
    by its COST. Returns (the scoring's events, each round's calls as (kind, rows, tokens,
    whether the scoring's row is in it), the chats' decode steps during the scoring, the
    clock when the scoring ended, the harness). `scoring_flag` False: its chunks go as any
    verify request of forced tokens (the control: before they took a share)."""
    art = fake_artifact(batch_ladder=(1, 2, 4), context_ladder=(32, 256), prefill_tokens=(32,),
                        verify_tokens=(3, 5, 9))
    h = Harness(art, prefill_wait_s=0.0)
    run = h.rt._execute

    def timed(entry_name, step):
        h.clock.advance(COST[entry_name.split("_")[0]])
        return run(entry_name, step)
    h.rt._execute = timed
    nexts, scored, rounds = [], [], []

    def queue(requests):
        for r in requests:
            r.scoring = r.scoring and scoring_flag
        nexts.extend(requests)

    def round_ended():
        if nexts:
            h.batcher.submit_group(nexts[:])
            nexts.clear()
    h.batcher.round_listeners.append(round_ended)
    spec = speculation or Speculation.of(h.batcher.engine, h.batcher.stats)
    params = SamplingParams.from_dict({"max_tokens": 1, "prompt_logprobs": 2})
    scorer = Generation(0, PROMPT, params, set(), 256, scored.append, queue, spec)
    chat = SamplingParams.from_dict({"max_tokens": 240})
    gens = [scorer] + [Generation(1 + i, [5 + i, 6, 7], chat, set(), 256, lambda e: None,
                                  queue, spec) for i in range(chats)]
    h.batcher.submit_group([g.start_request() for g in gens])
    seen = {}  # the jobs of each call the round ran, through the batcher's own _run
    real_run = h.batcher._run

    def recorded(kind, jobs):
        tokens = sum(len(j.seq.token_ids) - j.seq.num_cached for j in jobs)
        seen.setdefault("calls", []).append(
            (kind, len(jobs), tokens, any(j.request.reply_fn == scorer.on_reply for j in jobs)))
        return real_run(kind, jobs)
    h.batcher._run = recorded
    decode_steps, ended_at = 0, None
    for _ in range(5000):
        if scorer.finished and ended_at is None:
            ended_at = h.clock()
        if all(g.finished for g in gens) and not h.batcher.sequences:
            break
        seen["calls"] = []
        if not h.batcher.run_pending():
            h.clock.advance(0.001)  # past a wait
            continue
        rounds.append(seen["calls"])
        if not scorer.finished:
            decode_steps += sum(rows for kind, rows, _, mine in seen["calls"]
                                if kind == "decode" and not mine)
    assert all(g.finished for g in gens)
    return scored, rounds, decode_steps, ended_at, h


def scoring_calls(rounds):
    return [c for calls in rounds for c in calls if c[3]]


def test_a_prompt_is_scored_in_chunks_of_the_largest_verify_entry_one_a_round_beside_chats():
    alone = serve(0, Speculation(0, "no verify entries"))  # one token a decode step
    scored, rounds, decode_steps, ended_at, h = serve(2)
    # the same entries (each prompt token's from the logits after the one before) and token
    assert scored[0][2] == PROMPT_LOGPROBS and len(scored[0][5]) == len(PROMPT)
    assert [e[:2] for e in scored] == [e[:2] for e in alone[0]]
    assert scored[0][5] == alone[0][0][5]
    assert scored[1][1] == alone[0][1][1]
    # the START's one token, chunks of 9 (the largest verify entry), the last token alone
    mine = scoring_calls(rounds)
    chunks = [tokens for kind, _, tokens, _ in mine if kind == "verify"]
    assert chunks == [9] * 11 + [3]  # the 102 between the first and the last
    assert [k for k, *_ in mine] == ["prefill"] + ["verify"] * 12 + ["decode"]
    assert all(sum(c[3] for c in calls) <= 1 for calls in rounds)  # one chunk a round
    assert len(scoring_calls(alone[1])) > 7 * len(mine)  # a decode step a token
    # Its share: the chats decode all along, at least one step for every chunk, and the
    # chunks took at most about half of the time
    verify_s = COST["verify"] * len(chunks)
    assert decode_steps >= 2 * 8 * len(chunks), decode_steps
    assert verify_s / (ended_at - 100.0) < 0.6
    few = serve(2, dataclasses.replace(Speculation.of(h.batcher.engine), most_drafts=2))
    assert few[0][0][5] == scored[0][5]  # three tokens a call: the same entries ...
    assert len(scoring_calls(few[1])) > 2 * len(mine)  # ... in many more calls


def test_the_control_chunks_run_every_round_and_hold_the_chats_back():
    """Before chunks took a share, each ran in every round beside the chats' decode steps:
    the chats got about one step per chunk, the chunks most of the time."""
    scored, rounds, decode_steps, ended_at, _ = serve(2, scoring_flag=False)
    chunks = [c for c in scoring_calls(rounds) if c[0] == "verify"]
    assert decode_steps < 2 * 8 * len(chunks)
    assert COST["verify"] * len(chunks) / (ended_at - 100.0) > 0.6


def test_a_scoring_row_never_joins_the_decode_call_one_token_a_round():
    """A grammar's row of forced tokens joins the decode call when that yields more tokens a
    second (round_plan.forced_rows_to_decode); a scoring chunk of the same shape does not: fed
    one token a round, a prompt would take a call per token."""
    times = {("decode", 3, 1): 0.05, ("decode", 4, 1): 0.05, ("verify", 1, 9): 0.4}
    decode = [Request(f"d{i}", [1], False, False, print) for i in range(3)]
    chunk = step("s", 0.0, scoring=True)
    assert forced_rows_to_decode(decode + [chunk], lambda *k: times.get(k)) == []
    grammar = dataclasses.replace(chunk, scoring=False)  # the control: 4 / 50 ms beats 12 / 450
    assert forced_rows_to_decode(decode + [grammar], lambda *k: times.get(k)) == [grammar]


def step(seq_id, arrived, scoring=False, prompt=False):
    if prompt:
        return Request(seq_id, [1, 2, 3], True, False, print, arrived=arrived)
    return Request(seq_id, [1] * (9 if scoring else 1), False, False, print, arrived=arrived,
                   draft_tokens=8 if scoring else 0, forced_tokens=8 if scoring else 0,
                   scoring=scoring)


@pytest.mark.parametrize("others, waited, taken", [
    ([], 0.0, True),  # nothing else to run
    (["decode"], 0.3, False), (["decode"], 0.4, True),  # its share: a chunk's 0.4 s
    (["prompt"], 0.7, False), (["prompt"], 0.8, True),  # with a prompt in the round: twice it
])
def test_a_scoring_chunk_runs_once_it_sat_out_its_share(others, waited, taken):
    now = 10.0
    pending = [step("s", now - waited, scoring=True)] + [
        step(f"o{i}", now - 1.0, prompt=kind == "prompt") for i, kind in enumerate(others)]
    got, _ = select(pending, now=now, policy=BatchPolicy(prefill_wait_s=0.0),
                    cohort=Cohort(set()), held=set(), max_prefill_batch=1,
                    chunk_seconds=lambda r: 0.4)
    assert ("s" in [r.seq_id for r in got]) is taken
    assert [r.seq_id for r in got if r.seq_id != "s"] == [f"o{i}" for i in range(len(others))]
    # the control: a verify request of forced tokens that is no scoring runs at once
    plain = [dataclasses.replace(pending[0], scoring=False)] + pending[1:]
    got, _ = select(plain, now=now, policy=BatchPolicy(prefill_wait_s=0.0),
                    cohort=Cohort(set()), held=set(), max_prefill_batch=1,
                    chunk_seconds=lambda r: 0.4)
    assert "s" in [r.seq_id for r in got]


def test_a_prompt_longer_than_the_bound_is_refused_by_name(tmp_path):
    spec = Speculation(8, None, most_scored=5)
    params = SamplingParams.from_dict({"max_tokens": 1, "prompt_logprobs": 0})
    Generation(1, [1] * 5, params, set(), 64, print, print, spec)  # at the bound: scored
    with pytest.raises(SamplingError, match=r"prompt_logprobs: a prompt of 6 tokens .*\(5 at "
                                            r"most, its model parameter "
                                            r"prompt_logprobs_max_tokens\)"):
        Generation(1, [1] * 6, params, set(), 64, print, print, spec)
    Generation(1, [1] * 6, SamplingParams.from_dict({"max_tokens": 1}), set(), 64, print, print,
               spec)  # the control: the same prompt without prompt_logprobs
    assert Speculation().most_scored == default_int("prompt_logprobs_max_tokens")

    # Through tlaloc openai: the sequence model's refusal (INVALID_ARGUMENT) is a 400 naming it
    tok = ArtifactTokenizer(write_tokenizer(tmp_path))

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        try:
            Generation(1, input_ids, SamplingParams.from_dict(sampling), set(), 64, print,
                       print, spec)
        except SamplingError as e:
            return GenerateResult("", [], "error", len(input_ids), 0, 1, None, error=str(e),
                                  status="INVALID_ARGUMENT")
        return GenerateResult("Hi", [], "stop", len(input_ids), 1, 1, None)
    base, stop = serve_in_thread("unused:8001", {"m": ServedModel("m", "m_generate", tok, 100)},
                                 generate=generate)
    try:
        c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs_max_tokens"):
            c.completions.create(model="m", prompt=[1] * 6, extra_body={"prompt_logprobs": 1})
        assert c.completions.create(model="m", prompt=[1] * 6).choices[0].text == "Hi"
    finally:
        stop()

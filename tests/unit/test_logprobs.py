"""Log-probabilities (generation/logprobs.py, the generation's events, tlaloc openai's shapes):
an entry equals a float64 log-softmax of the raw logits, its top ids most likely first; a
generation asked for them sends one with each token; refused with speculation and grammars;
the openai package reads a chat's and a completion's logprobs, whole and streamed, in front of
a scripted generate (no Triton; the real model: tests/test_generate.py)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from test_chat_messages import write_tokenizer

from triton_tlaloc.frontends.client import GenerateResult, Piece
from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer
from triton_tlaloc.generation.local_generation import Generation
from triton_tlaloc.generation.logprobs import logprob_entry
from triton_tlaloc.generation.sampling import SamplingError, SamplingParams
from triton_tlaloc.scheduling.admission import Reply


def test_an_entry_is_the_log_softmax_of_the_raw_logits():
    logits = np.random.default_rng(0).standard_normal(500).astype(np.float32) * 5
    logits[7] = logits[9] = logits.max() + 1  # a tie at the top: the lower id first
    z = logits.astype(np.float64)
    want = z - z.max() - np.log(np.exp(z - z.max()).sum())
    lp, top = logprob_entry(logits, 42, 6)
    assert abs(lp - want[42]) < 1e-6
    assert [t for t, _ in top] == [7, 9, *np.argsort(-want, kind="stable")[2:6]]
    assert all(abs(v - want[t]) < 1e-6 for t, v in top)
    assert logprob_entry(logits, 3, 0)[1] == []


def test_a_generation_sends_each_tokens_entry_with_it():
    events = []
    params = SamplingParams.from_dict({"max_tokens": 2, "logprobs": 2})
    gen = Generation(1, [5, 6], params, {0}, 64, events.append, lambda r: None)
    row = np.zeros(16, np.float32)
    row[3], row[4] = 2.0, 1.0
    gen.on_reply(Reply(logits=row))
    gen.on_reply(Reply(logits=row))
    assert [e[:3] for e in events[:2]] == [[1, 3, None], [1, 3, "length"]]
    for e in events[:2]:
        assert e[5] == logprob_entry(row, 3, 2) and e[5][1][0][0] == 3


@pytest.mark.parametrize("d", [{"logprobs": 21}, {"prompt_logprobs": 21},
                               {"prompt_logprobs": 0, "structured_output": {"regex": "a"}},
                               {"prompt_logprobs": 0,
                                "speculative": {"method": "prompt_lookup"}}])
def test_what_logprobs_cannot_come_with_is_refused_by_name(d):
    """(logprobs come with speculation and grammars: test_a_verify_step_records_the_entries)"""
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams.from_dict(d)


ENTRY = [-0.25, [[72, -0.25], [73, -1.5]]]
PROMPT_ENTRY = [-2.0, [[72, -0.25], [73, -1.5]], 3]  # a prompt token's: its rank after


@pytest.fixture
def client(tmp_path):
    tok = ArtifactTokenizer(write_tokenizer(tmp_path))
    ids = tok.encode("Hi!", add_special_tokens=False)

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        entries = [ENTRY] * len(ids) if "logprobs" in sampling else None
        prompt = None
        if "prompt_logprobs" in sampling:
            prompt = [None] + [PROMPT_ENTRY] * (len(input_ids) - 1)
        if stream:
            for i, token in enumerate(ids):
                piece = Piece(tok.decode([token]))
                piece.token_ids, piece.logprobs = [token], None if entries is None else [ENTRY]
                on_text(piece)
        return GenerateResult("Hi!", ids, "stop", 3, len(ids), 1, 1.0, logprobs=entries,
                              prompt_logprobs=prompt)
    base, stop = serve_in_thread("unused:8001", {"m": ServedModel("m", "m_generate", tok, 100)},
                                 generate=generate)
    yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0), ids, tok
    stop()


def test_the_openai_client_reads_chat_and_completion_logprobs(client):
    c, ids, tok = client
    top = [(tok.token_text(72), -0.25), (tok.token_text(73), -1.5)]  # ENTRY's
    messages = [{"role": "user", "content": "hello"}]
    chat = c.chat.completions.create(model="m", messages=messages, logprobs=True,
                                     top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == "Hi!" and len(content) == len(ids)
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == top
    assert content[0].bytes == list(b"H")
    streamed = [t for chunk in c.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=2, stream=True)
        if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    assert c.chat.completions.create(model="m", messages=messages).choices[0].logprobs is None
    text = c.completions.create(model="m", prompt="x", logprobs=2)
    lp = text.choices[0].logprobs
    assert lp.tokens == ["H", "i", "!"] and lp.token_logprobs == [-0.25] * 3
    assert lp.text_offset == [0, 1, 2] and lp.top_logprobs[0] == dict(top)
    for kw, says in (({"logprobs": 2, "echo": True, "stream": True}, "echo with logprobs"),
                     ({"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
                     ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs: 21"),
                     ({"logprobs": 21}, "logprobs: 21")):
        with pytest.raises(openai.BadRequestError, match=says):
            c.completions.create(model="m", prompt="x", **kw)
    with pytest.raises(openai.BadRequestError, match="echo: only on /v1/completions"):
        c.chat.completions.create(model="m", messages=messages, extra_body={"echo": True})


def test_echo_gives_back_the_prompt_and_its_logprobs_before_the_completions(client):
    c, ids, tok = client
    prompt = tok.encode("ab", add_special_tokens=False)
    got = c.completions.create(model="m", prompt="ab", echo=True, logprobs=1, n=2)
    for choice in got.choices:
        lp = choice.logprobs
        assert choice.text == "abHi!"
        assert lp.tokens == [tok.token_text(t) for t in prompt + ids]
        assert lp.token_logprobs == [None, -2.0, -0.25, -0.25, -0.25]
        assert lp.top_logprobs[0] is None
        assert lp.top_logprobs[1] == {tok.token_text(72): -0.25}  # cut to logprobs 1
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model="m", prompt="ab", echo=True, stream=True))
    assert streamed == "abHi!"
    plain = c.completions.create(model="m", prompt="ab", extra_body={"prompt_logprobs": 1})
    pl = plain.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    assert pl[1] == {"72": {"logprob": -0.25, "rank": 1, "decoded_token": tok.token_text(72)},
                     str(prompt[1]): {"logprob": -2.0, "rank": 3,
                                      "decoded_token": tok.token_text(prompt[1])}}
    assert plain.choices[0].text == "Hi!" and plain.choices[0].logprobs is None
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                     extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(at) == 1 for at in chat.model_extra["prompt_logprobs"][1:])


class StepLog:
    """The requests a generation queues, each answered by hand."""

    def __init__(self):
        self.requests = []

    def __call__(self, requests):
        self.requests += requests


def logits_row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(16).astype(np.float32)


def test_a_verify_step_records_the_entries_of_the_tokens_it_yields():
    """Under speculation the tokens of a verify call (the drafts that stood and the one after
    them) each carry the entry of its own position's logits; greedy verify rows read the
    logits (an acceptor) instead of the device's argmax."""
    from triton_tlaloc.generation.local_generation import Speculation

    prompt = [5, 6, 7, 5, 6]  # prompt lookup drafts 7 after 5, 6
    events, steps = [], StepLog()
    params = SamplingParams.from_dict({"max_tokens": 8, "logprobs": 1, "speculative": {
        "method": "prompt_lookup", "num_draft_tokens": 2}})
    gen = Generation(1, prompt, params, {0}, 64, events.append, steps,
                     speculation=Speculation(3, None))
    first = logits_row(0)
    first[7] = 9.0
    gen.on_reply(Reply(logits=first))
    r = steps.requests[-1]
    assert r.tokens[0] == 7 and r.draft_tokens >= 1 and r.acceptor is not None
    rows = np.stack([logits_row(1 + i) for i in range(len(r.tokens))])
    rows[0, r.tokens[1]] = 9.0  # the first draft stands, then the argmax of the next row
    kept, following = r.acceptor(rows, r.tokens[1:])
    assert kept >= 1 and following == int(np.argmax(rows[kept]))
    gen.on_reply(Reply(accepted_ids=r.tokens[1:1 + kept] + [following]))
    tokens = [7] + r.tokens[1:1 + kept] + [following]
    assert [e[1] for e in events] == tokens
    assert events[0][5] == logprob_entry(first, 7, 1)
    for j, e in enumerate(events[1:]):
        assert e[5] == logprob_entry(rows[j], tokens[1 + j], 1)


@pytest.mark.parametrize("most_drafts", [0, 3])
def test_a_generation_scores_its_prompt_a_few_tokens_a_step(most_drafts):
    """Each prompt token's entry comes from the logits after the token before it, whether the
    prompt is fed one token a step or several a verify call; the last prompt token is fed
    alone, and its logits choose the first token; the entries go out before it."""
    from triton_tlaloc.generation.local_generation import PROMPT_LOGPROBS, Speculation
    from triton_tlaloc.generation.logprobs import ranked_entry

    prompt = [5, 6, 7, 8, 9, 10, 11]
    events, steps = [], StepLog()
    spec = Speculation(most_drafts, None if most_drafts else "no verify entries")
    params = SamplingParams.from_dict({"max_tokens": 1, "prompt_logprobs": 2})
    gen = Generation(1, prompt, params, {0}, 64, events.append, steps, speculation=spec)
    assert gen.start_request().tokens == [5]
    want, seed = [None], 0
    gen.on_reply(Reply(logits=logits_row(seed)))
    want.append(ranked_entry(logits_row(seed), 6, 2))
    while not events:
        r = steps.requests[-1]
        assert r.tokens == prompt[len(want) - 1:len(want) - 1 + len(r.tokens)]
        if r.draft_tokens:  # a verify call of forced tokens: all stand
            assert r.forced_tokens == r.draft_tokens and len(r.tokens) <= most_drafts + 1
            rows = np.stack([logits_row(seed + 1 + i) for i in range(len(r.tokens))])
            kept, following = r.acceptor(rows, r.tokens[1:])
            assert kept == r.draft_tokens
            for i in range(len(r.tokens)):
                want.append(ranked_entry(rows[i], prompt[len(want)], 2))
            assert following == prompt[len(want) - 1]
            seed += len(r.tokens)
            gen.on_reply(Reply(accepted_ids=r.tokens[1:] + [following]))
        else:
            seed += 1
            if len(want) < len(prompt):
                want.append(ranked_entry(logits_row(seed), prompt[len(want)], 2))
            gen.on_reply(Reply(logits=logits_row(seed)))
    assert steps.requests[-2].tokens == [11]  # the last prompt token alone
    if most_drafts:
        assert any(r.draft_tokens for r in steps.requests)
    assert events[0][2] == PROMPT_LOGPROBS and events[0][5] == want
    assert events[1][1] == int(np.argmax(logits_row(seed))) and events[1][2] == "length"


def test_a_verify_step_run_as_a_decode_row_feeds_its_first_token_only():
    """A round may run a verify row of forced tokens as a decode row (the batcher's
    forced_rows_to_decode): its acceptor sees one position and no forced tokens, and the
    scoring goes on from the next prompt token."""
    from triton_tlaloc.generation.local_generation import Speculation

    events, steps = [], StepLog()
    params = SamplingParams.from_dict({"max_tokens": 1, "prompt_logprobs": 0})
    gen = Generation(1, [5, 6, 7, 8, 9], params, {0}, 64, events.append, steps,
                     speculation=Speculation(3, None))
    gen.on_reply(Reply(logits=logits_row(0)))
    r = steps.requests[-1]
    assert r.tokens == [6, 7, 8]
    assert r.acceptor(logits_row(1)[None], []) == (0, 7)
    gen.on_reply(Reply(accepted_ids=[7]))
    assert steps.requests[-1].tokens == [7, 8]
    assert gen.scoring.fed == 2 and len(gen.scoring.entries) == 3

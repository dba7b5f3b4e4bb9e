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


@pytest.mark.parametrize("d", [{"logprobs": 2, "speculative": {"method": "prompt_lookup"}},
                               {"logprobs": 2, "structured_output": {"regex": "a"}},
                               {"logprobs": 21}])
def test_what_logprobs_cannot_come_with_is_refused_by_name(d):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams.from_dict(d)


ENTRY = [-0.25, [[72, -0.25], [73, -1.5]]]


@pytest.fixture
def client(tmp_path):
    tok = ArtifactTokenizer(write_tokenizer(tmp_path))
    ids = tok.encode("Hi!", add_special_tokens=False)

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        entries = [ENTRY] * len(ids) if "logprobs" in sampling else None
        if stream:
            for i, token in enumerate(ids):
                piece = Piece(tok.decode([token]))
                piece.token_ids, piece.logprobs = [token], None if entries is None else [ENTRY]
                on_text(piece)
        return GenerateResult("Hi!", ids, "stop", 3, len(ids), 1, 1.0, logprobs=entries)
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
    for kw, says in (({"logprobs": 2, "echo": True}, "echo: not supported"),
                     ({"logprobs": 21}, "logprobs: 21")):
        with pytest.raises(openai.BadRequestError, match=says):
            c.completions.create(model="m", prompt="x", **kw)

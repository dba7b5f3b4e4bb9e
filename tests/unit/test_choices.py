"""n choices on `tlaloc openai` (openai_server._generation, openai_responses.choice_events):
each its own seed, choice 0 first and the others once it has its first token (so they reuse
its prompt's blocks), a choice per index whole and streamed, the prompt counted once in the
usage, n out of range refused; through uvicorn and the `openai` package in front of a scripted
generate (no Triton; the real model: tests/test_generate.py)."""

from __future__ import annotations

import threading

import openai
import pytest

from triton_tlaloc.frontends.client import GenerateResult
from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread
from test_openai_doors import FakeTokenizer


@pytest.fixture
def served():
    log, lock = [], threading.Lock()

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        seed = sampling.get("seed")
        text = f"choice-{seed}"
        with lock:
            log.append(("start", seed, stream))
        if stream:
            for piece in (text[:4], text[4:]):
                with lock:
                    log.append(("piece", seed))
                on_text(piece)
        return GenerateResult(text, [1] * len(text), "stop", 3, len(text), 1, 1.0)
    base, stop = serve_in_thread("unused:8001", {"m": ServedModel("m", "m_generate",
                                                                  FakeTokenizer(), 100)},
                                 generate=generate)
    yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0), log
    stop()


MESSAGES = [{"role": "user", "content": "hi"}]


def test_n_choices_each_with_its_own_seed_choice_0_first(served):
    client, log = served
    got = client.chat.completions.create(model="m", messages=MESSAGES, n=3, seed=5)
    assert [(c.index, c.message.content) for c in got.choices] == [
        (0, "choice-5"), (1, "choice-6"), (2, "choice-7")]
    assert got.usage.prompt_tokens == 3 and got.usage.completion_tokens == 3 * 8
    # choice 0 (streamed inside, whatever the client asked) had its first piece before the
    # others started
    assert log[:2] == [("start", 5, True), ("piece", 5)]
    assert {entry[1] for entry in log[2:] if entry[0] == "start"} == {6, 7}
    text = client.completions.create(model="m", prompt="x", n=2, seed=1)
    assert [c.text for c in text.choices] == ["choice-1", "choice-2"]


def test_streamed_choices_come_by_index_with_one_usage_and_one_done(served):
    client, _ = served
    texts, finishes, usages = {}, {}, []
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, n=2, seed=5,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert texts == {0: "choice-5", 1: "choice-6"} and finishes == {0: "stop", 1: "stop"}
    assert len(usages) == 1 and usages[0].completion_tokens == 16


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused_and_nothing_generated(served, n):
    client, log = served
    with pytest.raises(openai.BadRequestError, match=f"n: {n}: from 1 to 16"):
        client.chat.completions.create(model="m", messages=MESSAGES, n=n)
    assert log == []


def test_n_over_the_free_slots_is_a_429_that_gives_back_the_slots_it_took():
    """With 2 generations allowed, n=3 takes two slots and is refused at the third: the two
    are given back, so a request of n=2 right after is served."""
    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        if stream:
            on_text("ok")
        return GenerateResult("ok", [1], "stop", 3, 1, 1, 1.0)
    from triton_tlaloc.frontends.openai_server import ServerOptions

    base, stop = serve_in_thread("unused:8001", {"m": ServedModel("m", "m_generate",
                                                                  FakeTokenizer(), 100)},
                                 options=ServerOptions(max_concurrent=2), generate=generate)
    try:
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m", messages=MESSAGES, n=3)
        got = client.chat.completions.create(model="m", messages=MESSAGES, n=2)
        assert [c.message.content for c in got.choices] == ["ok", "ok"]
    finally:
        stop()

"""LoRA adapters on `tlaloc openai` (vLLM's convention): each adapter of a model is a model of
its own name in /v1/models (its parent the base model), and a request naming it runs the base
model's generate model with the sampling parameter lora; the base model's requests carry none.
Through uvicorn and the `openai` package in front of a recording generate (no Triton; the real
path: tests/test_lora_server.py)."""

from __future__ import annotations

import openai
import pytest
from test_openai_doors import FakeTokenizer

from triton_tlaloc.frontends.client import GenerateResult
from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread


@pytest.fixture
def served():
    calls = []

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        calls.append((model, sampling.get("lora")))
        return GenerateResult("ok", [1, 2], "stop", 3, 2, 1, 1.0)
    base = ServedModel("base", "base_generate", FakeTokenizer(), 100)
    models = {"base": base, "sql": base.adapter("sql"), "chat": base.adapter("chat")}
    url, stop = serve_in_thread("unused:8001", models, generate=generate)
    yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0), calls
    stop()


def test_adapters_are_models_that_run_the_base_with_their_adapter(served):
    client, calls = served
    listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
    assert listed == {"base": None, "sql": "base", "chat": "base"}
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="sql", messages=messages)
    client.completions.create(model="chat", prompt="x")
    client.chat.completions.create(model="base", messages=messages)
    assert calls == [("base_generate", "sql"), ("base_generate", "chat"),
                     ("base_generate", None)]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")

"""LoRA adapters on `tlaloc openai` (vLLM's convention): each adapter of a model is a model of
its own name in /v1/models (its parent the base model), and a request naming it runs the base
model's generate model with the sampling parameter lora; the base model's requests carry none.
Adapters loaded and unloaded while serving, behind the admin key (closed without one), a
refusal passed on as a 400. Through uvicorn and the `openai` package in front of a recording
generate and sender (no Triton; the sequence model's side: tests/test_lora_server.py)."""

from __future__ import annotations

import openai
import pytest
from test_openai_doors import FakeTokenizer

from triton_tlaloc.frontends.client import GenerateResult
from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import ServerOptions, serve_in_thread


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


@pytest.fixture
def admin_served():
    sent = []

    def send(url, model, command, key):
        from triton_tlaloc.frontends.client import InferError
        assert key == "sesame"  # the sequence model checks it against its server's
        if command.get("load", {}).get("path") == "bad":
            raise InferError("[INVALID_ARG] lora_admin: adapter path 'bad' is outside the "
                             "directory adapters may be loaded from", "INVALID_ARGUMENT")
        if command.get("load", {}).get("path") == "fails":
            raise InferError("[INTERNAL] sequence 5: internal error admitting the request",
                             "INTERNAL")
        sent.append((model, command))

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        return GenerateResult("ok", [1, 2], "stop", 3, 2, 1, 1.0)
    base = ServedModel("base", "base_generate", FakeTokenizer(), 100)
    url, stop = serve_in_thread("unused:8001", {"base": base}, generate=generate,
                                options=ServerOptions(admin_key="sesame"), admin=send)
    yield url.removesuffix("/v1"), sent
    stop()


def post(base: str, path: str, body: dict, key: str | None = None):
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json",
               **({"x-tlaloc-admin-key": key} if key is not None else {})}
    request = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as got:
            return got.status, got.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_adapters_load_and_unload_behind_the_admin_key(admin_served):
    base, sent = admin_served
    load = {"lora_name": "late", "lora_path": "late-adapter"}
    assert post(base, "/v1/load_lora_adapter", load)[0] == 403
    assert post(base, "/v1/load_lora_adapter", load, "wrong")[0] == 403
    assert sent == []
    status, text = post(base, "/v1/load_lora_adapter", load, "sesame")
    assert status == 200 and "late" in text
    assert sent == [("base", {"load": {"name": "late", "path": "late-adapter"}})]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert {m.id for m in client.models.list().data} == {"base", "late"}
    status, text = post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "bad"},
                        "sesame")
    assert status == 400 and "outside the directory" in text
    # the sequence model's failure is the server's: a 500, not the client's 400
    status, text = post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "fails"},
                        "sesame")
    assert status == 500 and '"type":"server_error"' in text.replace(" ", "")
    assert post(base, "/v1/load_lora_adapter", load, "sesame")[0] == 400  # the name is taken
    status, _ = post(base, "/v1/unload_lora_adapter", {"lora_name": "late"}, "sesame")
    assert status == 200 and sent[-1] == ("base", {"unload": "late"})
    assert {m.id for m in client.models.list().data} == {"base"}


def test_the_admin_routes_are_closed_without_an_admin_key(served):
    client, _ = served
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    status, text = post(base, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "b"},
                        "anything")
    assert status == 404 and "--admin-key" in text

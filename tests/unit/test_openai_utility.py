"""`tlaloc openai`'s /tokenize, /detokenize, /health and /v1/models' max_model_len
(frontends/openai_utility.py), in vLLM's shapes: through a real uvicorn server with a real
(byte-level) tokenizer and chat template, in front of a fake readiness probe (no Triton)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from test_chat_messages import write_tokenizer

from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer


@pytest.fixture
def server(tmp_path):
    tok = ArtifactTokenizer(write_tokenizer(tmp_path))
    down = set()  # generate models the fake probe says are not ready
    models = {"m": ServedModel("m", "m_generate", tok, 300),
              "n": ServedModel("n", "n_generate", tok, 100)}
    base, stop = serve_in_thread("unused:8001", models,
                                 ready=lambda url, model: model not in down)
    yield base.removesuffix("/v1"), tok, down
    stop()


def call(base: str, path: str, body=None) -> tuple[int, dict | None]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as got:
            raw = got.read()
            return got.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_tokenize_gives_the_ids_a_generation_gets_and_detokenize_their_text(server):
    base, tok, _ = server
    status, got = call(base, "/tokenize", {"model": "m", "prompt": "Hello, world"})
    assert status == 200 and got["tokens"] == tok.encode("Hello, world")
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 300
    messages = [{"role": "user", "content": "Hi <|im_start|>there"}]
    status, got = call(base, "/tokenize", {"model": "m", "messages": messages})
    assert status == 200 and got["tokens"] == tok.apply_chat_template(messages)
    status, back = call(base, "/detokenize", {"model": "m", "tokens": tok.encode("Hello")})
    assert (status, back) == (200, {"prompt": "Hello"})
    for path, body, code, says in (
            ("/tokenize", {"model": "m"}, 400, "prompt or messages"),
            ("/tokenize", {"model": "m", "prompt": 5}, 400, "prompt: a string"),
            ("/tokenize", {"model": "x", "prompt": "a"}, 404, "not served here"),
            ("/tokenize", {"model": "m", "messages": [{"role": "bot", "content": "a"}]}, 400,
             "messages[0].role"),
            ("/detokenize", {"model": "m", "tokens": [1, -2]}, 400,
             "tokens: token id -2 (at 1) is negative"),
            ("/detokenize", {"model": "m", "tokens": "12"}, 400, "tokens: a list of token")):
        status, got = call(base, path, body)
        assert status == code and says in got["error"]["message"], (path, body, got)


def test_health_is_503_naming_a_model_that_is_not_ready(server):
    base, _, down = server
    assert call(base, "/health") == (200, None)
    down.add("n_generate")
    status, got = call(base, "/health")
    assert status == 503 and got["error"]["message"] == "not ready: n"
    down.clear()
    assert call(base, "/health")[0] == 200


def test_the_model_list_gives_each_models_largest_context(server):
    base, _, _ = server
    status, got = call(base, "/v1/models")
    assert status == 200 and [(m["id"], m["max_model_len"]) for m in got["data"]] == [
        ("m", 300), ("n", 100)]

"""The doors of `tlaloc openai` (an API key, the body's size and type, malformed bodies, the Host
header, CORS, the generations in flight, slow clients), the generate model's refusals as HTTP
statuses, and cancellation when the client goes: a real uvicorn server on a loopback port,
spoken to in raw HTTP, in front of a fake `generate` and a fake tokenizer (no Triton)."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from triton_tlaloc.frontends import openai_requests, openai_server
from triton_tlaloc.frontends.client import GenerateResult, Piece
from triton_tlaloc.frontends.openai_server import ServedModel, ServerOptions, serve_in_thread

KEY = "sekret-key-0123"

# The fake generate's script, by the prompt's first token id (any other: "hel" + "lo").
BLOCKS = 900  # streams "first" if streamed, then waits until cancelled or released
ERRORS = {901: "UNAVAILABLE", 902: "INVALID_ARGUMENT", 903: "DEADLINE_EXCEEDED",
          904: "INTERNAL", 905: None}
RAISES = 906  # generate raises
ERROR_AFTER_A_PIECE = 907  # streams "partial", then fails UNAVAILABLE
TIMES_OUT = 908  # generate's own wait for a response runs out
LINGERS = 909  # streams "first" if streamed, then ends only once `wound_down`, cancelled or not


def result(text: str, finish: str = "stop", error: str | None = None,
           status: str | None = None) -> GenerateResult:
    return GenerateResult(text, list(range(len(text))), finish, 3, len(text), 1, 1.0, error,
                          status)


def piece(text: str, ids: list[int]) -> Piece:
    p = Piece(text)
    p.token_ids = ids
    return p


class FakeGenerate:
    """A `generate` (client.generate's signature) that plays its script; each call is recorded
    with its cancel event, and `release` ends the blocked ones."""

    def __init__(self):
        self.calls: list[SimpleNamespace] = []
        self.release = threading.Event()
        self.wound_down = threading.Event()

    def __call__(self, url, model, *, input_ids, sampling, stream, on_text, cancel):
        call = SimpleNamespace(input_ids=input_ids, sampling=sampling, stream=stream,
                               cancel=cancel, ended=threading.Event())
        self.calls.append(call)
        try:
            return self._play(call, on_text)
        finally:
            call.ended.set()

    def _play(self, call, on_text):
        input_ids, stream, cancel = call.input_ids, call.stream, call.cancel
        first = input_ids[0] if input_ids else None
        if first == BLOCKS:
            if stream:
                on_text("first")
            while not (cancel.is_set() or self.release.is_set()):
                time.sleep(0.01)
            return result("first", "cancelled" if cancel.is_set() else "stop")
        if first in ERRORS:
            return result("", "error", f"refused with {ERRORS[first]}", ERRORS[first])
        if first == RAISES:
            raise RuntimeError("the stream broke")
        if first == TIMES_OUT:
            raise TimeoutError("m_generate: no response in 120 s")
        if first == LINGERS:  # a generate model a while ending a cancelled sequence
            if stream:
                on_text("first")
            self.wound_down.wait(10)
            return result("first", "cancelled" if cancel.is_set() else "stop")
        if first == ERROR_AFTER_A_PIECE:
            on_text("partial")
            return result("partial", "error", "the server is unloading", "UNAVAILABLE")
        if stream:
            on_text(piece("hel", [0, 1, 2]))
            on_text(piece("lo", [3, 4]))
            on_text("")  # the final response's empty text, as client.generate passes it
        return result("hello")

    def wait_for_calls(self, count: int) -> SimpleNamespace:
        """The `count`th call, once it has come (10 s at most: a loaded machine is slow)."""
        deadline = time.monotonic() + 10
        while len(self.calls) < count:
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.005)
        return self.calls[count - 1]


class FakeTokenizer:
    """Code points as token ids (a prompt of digits is not needed: token-id prompts pick the
    script); `slow_from` characters or more make encode wait (up to 2 s, or until released)."""

    def __init__(self, slow_from: int | None = None):
        self.slow_from = slow_from
        self.encoded = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        if self.slow_from is not None and len(text) >= self.slow_from:
            self.entered.set()
            self.release.wait(2)
        return [ord(c) for c in text[:64]]

    def apply_chat_template(self, messages: list[dict], **variables) -> list[int]:
        return self.encode("".join(str(m.get("content")) for m in messages))


class Server:
    def __init__(self, options: ServerOptions, tokenizer: FakeTokenizer):
        self.generate = FakeGenerate()
        self.tokenizer = tokenizer
        model = ServedModel("m", "m_generate", tokenizer, max_context=100)
        base, self._stop = serve_in_thread("unused:8001", {"m": model}, options=options,
                                           generate=self.generate)
        self.port = int(base.rsplit(":", 1)[1].split("/")[0])

    def stop(self):
        self.generate.release.set()
        self.generate.wound_down.set()
        self.tokenizer.release.set()
        self._stop()

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None,
                headers: dict | None = None, key: str | None = None, timeout: float = 5):
        """(status, headers, body) of one request; a dict body goes as JSON."""
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        sent.update(headers or {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=data, headers=sent)
            got = conn.getresponse()
            return got.status, got.headers, got.read()
        finally:
            conn.close()

    def post(self, path: str, body, **kw):
        return self.request("POST", path, body, **kw)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


@pytest.fixture
def start():
    """start(**ServerOptions fields, slow_from=None): a server; all are stopped at the end."""
    servers = []

    def started(slow_from: int | None = None, **options) -> Server:
        servers.append(Server(ServerOptions(**options), FakeTokenizer(slow_from)))
        return servers[-1]
    yield started
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def plain():
    """A server with the default options, shared by the tests that change nothing."""
    s = Server(ServerOptions(), FakeTokenizer())
    yield s
    s.stop()


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def events(body: bytes) -> list:
    """The data of a stream's server-sent events ("[DONE]" kept as a string)."""
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        piece = sock.recv(65536)
        if not piece:
            break
        got += piece
    return got


def read_all(sock: socket.socket) -> bytes:
    got = b""
    while piece := sock.recv(65536):
        got += piece
    return got


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# ------------------------------------------------------------------ the generations themselves

def test_completions_and_chat_answer_through_the_given_generate(plain):
    status, _, body = plain.post("/v1/completions", COMPLETION)
    assert status == 200
    got = json.loads(body)
    assert got["choices"][0]["text"] == "hello" and got["usage"]["completion_tokens"] == 5
    assert plain.generate.calls[-1].input_ids == [ord("h"), ord("i")]
    assert plain.generate.calls[-1].sampling == {"max_tokens": 16, "temperature": 1.0,
                                                 "top_p": 1.0}
    # asked of the generate model as a stream all the same: generate's wait for a response
    # then bounds the time between tokens, not a long completion's whole length
    assert plain.generate.calls[-1].stream
    status, _, body = plain.post("/v1/chat/completions", {
        **CHAT, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0})
    assert status == 200
    chunks = events(body)
    assert chunks[-1] == "[DONE]"
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:-1]] == [
        "hel", "lo", None]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and "usage" in chunks[-2]
    # the chat default: what the largest context (100) leaves after the 2-token prompt
    assert plain.generate.calls[-1].sampling == {"max_tokens": 98, "temperature": 0,
                                                 "top_p": 1.0}


def test_return_token_ids_and_ignore_eos_as_vllm_takes_them(plain):
    """vLLM's extensions: return_token_ids gives the prompt's ids (a completion's choice's, a
    chat's own) and each choice's (streamed: each chunk's); ignore_eos is passed on."""
    prompt = [ord("h"), ord("i")]
    status, _, body = plain.post("/v1/completions", {**COMPLETION, "return_token_ids": True,
                                                     "ignore_eos": True})
    assert status == 200
    got = json.loads(body)["choices"][0]
    assert (got["prompt_token_ids"], got["token_ids"]) == (prompt, [0, 1, 2, 3, 4])
    assert plain.generate.calls[-1].sampling["ignore_eos"] is True
    status, _, body = plain.post("/v1/chat/completions", {**CHAT, "return_token_ids": True})
    got = json.loads(body)
    assert (got["prompt_token_ids"], got["choices"][0]["token_ids"]) == (prompt, [0, 1, 2, 3, 4])
    for path, request in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        status, _, body = plain.post(path, {**request, "stream": True, "return_token_ids": True})
        chunks = events(body)[:-1]
        assert [c["choices"][0].get("token_ids") for c in chunks] == [[0, 1, 2], [3, 4], None]
        first = chunks[0] if path.endswith("chat/completions") else chunks[0]["choices"][0]
        assert first["prompt_token_ids"] == prompt
        assert not any("prompt_token_ids" in c for c in chunks[1:])
    status, _, body = plain.post("/v1/completions", {**COMPLETION, "stream": True})
    assert not any("token_ids" in c["choices"][0] for c in events(body)[:-1])
    status, _, body = plain.post("/v1/completions", {**COMPLETION, "return_token_ids": 1})
    assert status == 400 and b"return_token_ids" in body


# ------------------------------------------------------------------ the API key

def test_every_route_asks_for_the_api_key(start):
    s = start(api_key=KEY)
    for method, path, body in (("GET", "/v1/models", None),
                               ("POST", "/v1/completions", COMPLETION),
                               ("POST", "/v1/chat/completions", CHAT)):
        for key in (None, "wrong", KEY[:-1], ""):
            status, headers, got = s.request(method, path, body, key=key)
            assert status == 401, (path, key)
            assert error_of(got)["type"] == "authentication_error"
            assert headers["WWW-Authenticate"] == "Bearer"
        status, _, got = s.request(method, path, body, key=KEY)
        assert status == 200, (path, got)
    status, _, _ = s.request("GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert status == 401
    assert len(s.generate.calls) == 2  # only the requests with the key generated
    assert KEY not in repr(ServerOptions(api_key=KEY))


# ------------------------------------------------------------------ the body

def test_a_body_over_the_limit_is_refused_by_its_content_length_before_it_is_read(start):
    s = start(max_body_bytes=1000)
    with s.connect() as sock:  # says 1 GB, sends nothing: the answer cannot wait for it
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        response = read_all(sock)
    assert status_of(response) == 413
    assert b"1000 bytes" in response
    assert s.post("/v1/completions", COMPLETION, raw=b" " * 1001 + b"{}")[0] == 413
    assert s.generate.calls == []


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(start):
    s = start(max_body_bytes=1000)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"258\r\n" + b" " * 600 + b"\r\n"
    with s.connect() as sock:  # 1200 bytes and no last chunk: it must not wait for the end
        sock.sendall(head + chunk + chunk)
        response = read_all(sock)
    assert status_of(response) == 413
    body = json.dumps(COMPLETION).encode()
    with s.connect() as sock:  # a chunked body under the limit is read and answered
        sock.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        response = read_all(sock)
    assert status_of(response) == 200 and b'"text":"hello"' in response


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), (None, 415),
    ("application/json; charset=utf-8", 200), ("Application/JSON", 200)])
def test_a_generation_route_takes_json_only(plain, content_type, status):
    headers = {} if content_type is None else {"Content-Type": content_type}
    conn = http.client.HTTPConnection("127.0.0.1", plain.port, timeout=5)
    conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION).encode(),
                 headers=headers)
    got = conn.getresponse()
    body = got.read()
    conn.close()
    assert got.status == status, body
    if status == 415:
        assert error_of(body)["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body, named", [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", b"\xff\xfe{}", "not valid JSON"),
    ("/v1/completions", b"[" * 100_000, "not valid JSON"),
    ("/v1/completions", b'{"model": "m", "prompt": "hi", "temperature": NaN}', "NaN"),
    ("/v1/completions", b"[1, 2]", "not an object"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "abc"}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_completion_tokens": True}, "max_completion_tokens"),
    ("/v1/completions", {**COMPLETION, "temperature": []}, "temperature"),
    ("/v1/completions", b'{"model": "m", "prompt": "hi", "top_p": 1e999}',
     "top_p: a finite number"),
    ("/v1/completions", {**COMPLETION, "seed": "1"}, "seed"),
    ("/v1/completions", {**COMPLETION, "stop": [1]}, "stop"),
    ("/v1/completions", {**COMPLETION, "n": "two"}, "n:"),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream:"),
    ("/v1/completions", {**COMPLETION, "stream_options": "x"}, "stream_options"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("/v1/completions", {**COMPLETION, "model": ["m"]}, "model"),
    ("/v1/completions", {"model": "m", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": [1, -5]}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": [1, 2**40]}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": "x"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [5]}, "messages[0]"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "temperature": {}}, "temperature"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]: part type image_url is not supported: text only"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "narrator", "content": "x"}]},
     'messages[0].role: "narrator" is not supported'),
    ("/v1/completions", {**COMPLETION, "stop": ""}, "stop: an empty stop string"),
    ("/v1/completions", {**COMPLETION, "stop": ["a", ""]}, "stop: an empty stop string"),
])
def test_a_malformed_body_is_a_400_naming_the_problem(plain, path, body, named):
    raw = body if isinstance(body, bytes) else None
    status, _, got = plain.post(path, None if raw else body, raw=raw)
    assert status == 400, got
    error = error_of(got)
    assert named in error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == 400


def test_a_prompt_over_the_limit_is_refused_before_it_is_tokenized(start):
    s = start(max_prompt_chars=1000)
    status, _, got = s.post("/v1/completions", {"model": "m", "prompt": "x" * 1001})
    assert status == 400 and "1001 characters" in error_of(got)["message"]
    status, _, got = s.post("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "x" * 600},
        {"role": "user", "content": [{"type": "text", "text": "y" * 401}]}]})
    assert status == 400 and "1001 characters" in error_of(got)["message"]
    status, _, got = s.post("/v1/completions", {"model": "m", "prompt": [1] * 1001})
    assert status == 400 and "1001 token ids" in error_of(got)["message"]
    assert s.tokenizer.encoded == 0
    assert s.post("/v1/completions", {"model": "m", "prompt": "x" * 1000})[0] == 200


def test_tokenizing_a_long_prompt_does_not_hold_up_other_requests(start):
    s = start(slow_from=100_000)
    answered = []
    long = threading.Thread(target=lambda: answered.append(
        s.post("/v1/completions", {"model": "m", "prompt": "x" * 900_000})[0]))
    long.start()
    assert s.tokenizer.entered.wait(2)
    t0 = time.perf_counter()
    status, _, _ = s.request("GET", "/v1/models")
    assert status == 200 and time.perf_counter() - t0 < 0.5
    s.tokenizer.release.set()
    long.join(5)
    assert answered == [200]


# ------------------------------------------------------------------ the Host header and CORS

@pytest.mark.parametrize("host, status", [
    ("evil.example", 400), ("evil.example:{port}", 400), ("127.0.0.2:{port}", 400),
    ("localhost:{port}", 200), ("127.0.0.1:{port}", 200), ("[::1]:{port}", 200),
    ("localhost", 200)])
def test_bound_to_loopback_only_loopback_names_are_accepted(plain, host, status):
    got = plain.request("GET", "/v1/models", headers={"Host": host.format(port=plain.port)})
    assert got[0] == status


def test_the_allowed_hosts_follow_the_bind_host_unless_given(start):
    assert ServerOptions().for_host("0.0.0.0").allowed_hosts == ("*",)
    assert ServerOptions().for_host("192.168.1.7").allowed_hosts == ("*",)
    assert "localhost" in ServerOptions().for_host("::1").allowed_hosts
    given = ServerOptions(allowed_hosts=("api.example",))
    assert given.for_host("127.0.0.1") is given
    s = start(allowed_hosts=("api.example",))
    assert s.request("GET", "/v1/models", headers={"Host": "api.example:1"})[0] == 200
    assert s.request("GET", "/v1/models", headers={"Host": "localhost"})[0] == 400


def test_cors_headers_go_to_the_configured_origins_only(start, plain):
    s = start(api_key=KEY, cors_origins=("http://app.example",))
    status, headers, _ = s.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200  # a preflight carries no key: it is answered before the key door
    assert headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    status, headers, _ = s.request("GET", "/v1/models", key=KEY,
                                   headers={"Origin": "http://app.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://app.example"
    _, headers, _ = s.request("GET", "/v1/models", key=KEY,
                              headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers
    _, headers, _ = plain.request("GET", "/v1/models", headers={"Origin": "http://app.example"})
    assert "Access-Control-Allow-Origin" not in headers


# ------------------------------------------------------------------ generations in flight

def test_a_generation_over_the_most_in_flight_is_a_429_at_once(start):
    s = start(max_concurrent=2)
    blocked = {"model": "m", "prompt": [BLOCKS]}
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(
        s.post("/v1/completions", blocked)[0])) for _ in range(2)]
    for t in threads:
        t.start()
    s.generate.wait_for_calls(2)
    t0 = time.perf_counter()
    status, headers, got = s.post("/v1/completions", COMPLETION)
    assert status == 429 and time.perf_counter() - t0 < 0.5
    assert headers["Retry-After"] == "1" and error_of(got)["code"] == 429
    assert s.request("GET", "/v1/models")[0] == 200  # not a generation
    s.generate.release.set()
    for t in threads:
        t.join(5)
    assert answers == [200, 200]
    assert s.post("/v1/completions", COMPLETION)[0] == 200  # the slots came back


# ------------------------------------------------------------------ the generate model's errors

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("first_id, status, kind", [
    (901, 503, "service_unavailable"), (902, 400, "invalid_request_error"),
    (903, 504, "timeout"), (904, 500, "server_error"), (905, 500, "server_error"),
    (RAISES, 500, "server_error"), (TIMES_OUT, 504, "timeout")])
def test_a_refusal_at_the_start_is_answered_with_its_status(plain, stream, first_id, status,
                                                            kind):
    got_status, _, got = plain.post("/v1/completions", {"model": "m", "prompt": [first_id],
                                                        "stream": stream})
    assert got_status == status, got
    assert error_of(got)["type"] == kind and error_of(got)["code"] == status


def test_an_error_after_the_stream_began_is_an_event_with_its_status(plain):
    status, _, body = plain.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": chr(ERROR_AFTER_A_PIECE)}],
        "stream": True})
    assert status == 200
    got = events(body)
    assert got[0]["choices"][0]["delta"]["content"] == "partial"
    assert got[1]["error"]["code"] == 503 and got[1]["error"]["type"] == "service_unavailable"
    assert got[2] == "[DONE]"


# ------------------------------------------------------------------ cancellation

def request_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_gone_mid_stream_cancels_its_generation(start, path):
    s = start(max_concurrent=1)
    body = ({"model": "m", "prompt": [BLOCKS]} if "chat" not in path else
            {"model": "m", "messages": [{"role": "user", "content": chr(BLOCKS)}]})
    with s.connect() as sock:
        sock.sendall(request_bytes(path, {**body, "stream": True}))
        assert b'"first"' in read_until(sock, b'"first"')
    assert s.generate.calls[0].cancel.wait(1), "not cancelled within 1 s of the disconnect"
    deadline = time.monotonic() + 1  # its slot comes back as the generation ends
    while s.post("/v1/completions", COMPLETION)[0] == 429 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.post("/v1/completions", COMPLETION)[0] == 200


def test_a_client_gone_before_its_whole_completion_cancels_its_generation(start):
    s = start(max_concurrent=1)
    with s.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", {"model": "m", "prompt": [BLOCKS]}))
        s.generate.wait_for_calls(1)
    assert s.generate.calls[0].cancel.wait(1), "not cancelled within 1 s of the disconnect"
    deadline = time.monotonic() + 1
    while s.post("/v1/completions", COMPLETION)[0] == 429 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.post("/v1/completions", COMPLETION)[0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_gives_its_slot_back_before_its_generation_winds_down(start, stream):
    s = start(max_concurrent=1)
    with s.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", {"model": "m", "prompt": [LINGERS],
                                                       "stream": stream}))
        if stream:
            assert b'"first"' in read_until(sock, b'"first"')
        else:
            s.generate.wait_for_calls(1)
    lingering = s.generate.calls[0]
    assert lingering.cancel.wait(1), "not cancelled within 1 s of the disconnect"
    deadline = time.monotonic() + 1  # its slot comes back now, not when generate returns
    while s.post("/v1/completions", COMPLETION)[0] == 429 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.post("/v1/completions", COMPLETION)[0] == 200
    assert not lingering.ended.is_set()
    s.generate.wound_down.set()
    assert lingering.ended.wait(2)
    # its end gave nothing back a second time: one generation in flight still fills the limit
    calls = len(s.generate.calls)  # counted before the holder starts: its call may come first
    holder = threading.Thread(target=s.post, args=("/v1/completions",
                                                   {"model": "m", "prompt": [BLOCKS]}))
    holder.start()
    s.generate.wait_for_calls(calls + 1)
    assert s.post("/v1/completions", COMPLETION)[0] == 429
    s.generate.release.set()
    holder.join(5)


def test_a_client_that_stays_is_not_cancelled(plain):
    calls = len(plain.generate.calls)
    with plain.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", {"model": "m", "prompt": [BLOCKS]}))
        call = plain.generate.wait_for_calls(calls + 1)
        assert not call.cancel.wait(0.5)
        plain.generate.release.set()
        assert status_of(read_until(sock, b"\r\n")) == 200
    plain.generate.release.clear()


# ------------------------------------------------------------------ slow clients

def dribble(sock: socket.socket, data: bytes, seconds: float) -> tuple[float | None, bytes]:
    """Sends `data` a byte a second until the server closes the connection: (the seconds that
    took, or None if it was still open after `seconds`; what the server answered meanwhile)."""
    t0, got = time.monotonic(), b""
    sock.settimeout(1.0)
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
            while piece := sock.recv(65536):
                got += piece
            return time.monotonic() - t0, got
        except socket.timeout:  # a second without the connection closing: the next byte
            pass
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0, got
        if time.monotonic() - t0 > seconds:
            break
    return None, got


def test_connections_sending_their_headers_a_byte_a_second_are_closed(start):
    s = start(header_timeout_s=1.5)
    head = request_bytes("/v1/completions", COMPLETION)
    socks = [s.connect() for _ in range(4)]
    took = []
    threads = [threading.Thread(target=lambda c=c: took.append(dribble(c, head, 4)[0]))
               for c in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for c in socks:
        c.close()
    assert len(took) == 4 and all(t is not None and t < 3.5 for t in took), took
    assert s.post("/v1/completions", COMPLETION)[0] == 200  # the server still answers


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(start):
    s = start(header_timeout_s=1.5)
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION).encode(),
                 headers={"Content-Type": "application/json"})
    assert conn.getresponse().read() and conn.sock is not None  # kept alive
    took, _ = dribble(conn.sock, request_bytes("/v1/completions", COMPLETION), 4)
    conn.close()
    assert took is not None and took < 3.5, took


def test_a_body_sent_a_byte_a_second_is_refused_at_its_deadline(start):
    s = start(body_timeout_s=1.5)
    body = json.dumps(COMPLETION).encode()
    with s.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", COMPLETION)[:-len(body)])  # the headers
        took, got = dribble(sock, body, 4)
    assert took is not None and took < 3.5, took
    assert status_of(got) == 408 and b"1.5 s" in got
    assert s.generate.calls == []


def test_the_deadlines_do_not_cut_a_long_answer_short(start):
    s = start(header_timeout_s=0.5, body_timeout_s=0.5)
    with s.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", {"model": "m", "prompt": [BLOCKS]}))
        s.generate.wait_for_calls(1)
        time.sleep(1.5)
        s.generate.release.set()
        assert status_of(read_until(sock, b"\r\n")) == 200


def test_the_server_options_refuse_no_deadline():
    for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
        with pytest.raises(ValueError, match=f"{name} 0: must be above 0"):
            ServerOptions(**{name: 0})


# ------------------------------------------------------------------ the command line

def test_the_command_line_builds_the_options(monkeypatch, capsys):
    from triton_tlaloc import cli

    served = []
    monkeypatch.setattr(ServedModel, "discover_with_adapters", staticmethod(
        lambda url, name, tokenizer_dir=None, tool_parser="auto", reasoning_parser="auto":
        {name: ServedModel(name, name + "_generate", FakeTokenizer(), 100, tool_parser,
                           reasoning_parser)}))
    monkeypatch.setattr(openai_server, "serve", lambda url, models, host, port, *, options:
                        served.append((host, port, options)))

    def run(*argv):
        args = cli.build_parser().parse_args(["openai", "--model", "m", *argv])
        assert args.fn(args) == 0
        return served[-1][2]

    monkeypatch.delenv("TLALOC_API_KEY", raising=False)
    options = run()
    assert options.api_key is None and "localhost" in options.allowed_hosts
    assert (options.max_body_bytes, options.max_concurrent, options.cors_origins,
            options.max_prompt_chars) == (4 * 1024 * 1024, 64, (), 1_000_000)
    assert capsys.readouterr().err == ""
    options = run("--host", "0.0.0.0", "--max-body-bytes", "10", "--max-concurrent", "3",
                  "--cors-origin", "http://a", "--cors-origin", "http://b",
                  "--max-prompt-chars", "7")
    assert options.allowed_hosts == ("*",) and options.cors_origins == ("http://a", "http://b")
    assert (options.max_body_bytes, options.max_concurrent, options.max_prompt_chars) == (
        10, 3, 7)
    assert (options.header_timeout_s, options.body_timeout_s, options.keep_alive_s,
            options.max_header_bytes) == (10.0, 60.0, 5.0, 16 * 1024)  # the defaults
    options = run("--header-timeout-s", "2.5", "--body-timeout-s", "7", "--keep-alive-s", "1",
                  "--max-header-bytes", "4096")
    assert (options.header_timeout_s, options.body_timeout_s, options.keep_alive_s,
            options.max_header_bytes) == (2.5, 7.0, 1.0, 4096)
    assert "warning" in capsys.readouterr().err  # no key on a public address
    monkeypatch.setenv("TLALOC_API_KEY", "from-env")
    assert run("--host", "0.0.0.0", "--allowed-host", "api.example").api_key == "from-env"
    assert served[-1][2].allowed_hosts == ("api.example",)
    assert run("--api-key", KEY).api_key == KEY  # the flag wins
    out = capsys.readouterr()
    assert KEY not in out.out + out.err and "from-env" not in out.out + out.err
    assert os.environ["TLALOC_API_KEY"] == "from-env"


def test_response_format_and_the_guided_fields_become_structured_output():
    """What a body asks to constrain, as the generate model's structured_output: OpenAI's
    response_format (strict or not), this server's field, vLLM's guided_* fields; at most one,
    and anything else a 400 naming the field."""
    asked = openai_requests._structured_output
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert asked({}) is None and asked({"response_format": {"type": "text"}}) is None
    assert asked({"response_format": {"type": "json_object"}}) == {"json_object": True}
    assert asked({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}}) == {"json_schema": schema,
                                                              "strict": True}
    assert asked({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}) == {"json_schema": schema, "strict": False}
    assert asked({"structured_output": {"regex": "a+"}}) == {"regex": "a+"}
    assert asked({"guided_json": json.dumps(schema)}) == {"json_schema": schema}
    assert asked({"guided_choice": ["a", "b"]}) == {"choice": ["a", "b"]}
    for body, says in (
            ({"response_format": "json"}, "response_format: an object"),
            ({"response_format": {"type": "yaml"}}, 'response_format.type: "yaml" is not'),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: req"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
             "response_format.json_schema.schema: a JSON schema object"),
            ({"guided_json": "{not json"}, "guided_json: not a JSON schema"),
            ({"guided_regex": "a", "response_format": {"type": "json_object"}},
             "response_format and guided_regex: at most one constraint")):
        with pytest.raises(openai_requests.APIError, match=re.escape(says)):
            asked(body)
    sampling = openai_requests._sampling({"response_format": {"type": "json_object"}})
    assert sampling["structured_output"] == {"json_object": True}

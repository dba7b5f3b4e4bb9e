"""`tlaloc openai`: an OpenAI-compatible HTTP server in front of a generate model.

    GET  /v1/models
    POST /v1/completions         prompt (text or token ids)
    POST /v1/chat/completions    messages, rendered with the artifact's chat template

`stream: true` answers with server-sent events (`data: {chunk}` lines, then `data: [DONE]`).
Each request becomes one request to NAME_generate over a gRPC stream (client.generate, or the
`generate` given to make_app). Built on FastAPI and uvicorn, as vllm's OpenAI server is.
Sampling follows the OpenAI API's defaults (temperature 1, top_p 1, max_tokens 16 for
completions; a chat completion runs to the end of the sequence or the largest context unless
max_tokens says otherwise).

The doors (http_doors.py; ServerOptions sets them): the Host header (bound to a loopback
address, only the loopback names), CORS for configured origins only, an optional API key, the
body's size, JSON Content-Type and deadline, the generations in flight (429 over the limit),
and a deadline for each request's headers (a client sending them a byte at a time is cut off).
A malformed body is a 400 naming the field; the body is parsed and the prompt tokenized off the
event loop. Chat messages are text: content parts other than text, and roles other than
system, developer, user, assistant and tool, are refused by name; special-token text in content
is tokenized as plain text (tokenizer.py), so a message cannot forge the template's turns. The
generate model's refusals keep their meaning: INVALID_ARGUMENT is 400, UNAVAILABLE 503,
DEADLINE_EXCEEDED 504. A stream is answered only once its first piece has
come, so a refusal at the start gets its status rather than 200 and an error event.

Cancellation: each generation runs on a worker thread of its own, handing its pieces to the
event loop. A client that disconnects, mid-stream or while waiting for a whole completion,
sets the generation's cancel event within a fraction of a second and gives its slot back at
once; the generate model then ends the sequence, which frees its pages.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field, replace

# at module level: FastAPI resolves the annotations here
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .client import generate as grpc_generate
from .openai_responses import Reply, completion_body, events, refusal
from .http_doors import (APIError, GenerationSlots, add_doors, default_allowed_hosts,
                         guarded_h11_protocol, number, parse_body, shown, typed)
from .tokenizer import ArtifactTokenizer, LiteralContentError


@dataclass
class ServedModel:
    name: str  # the name clients use: the sequence model's
    generate_model: str
    tokenizer: ArtifactTokenizer  # or anything with encode(text) and apply_chat_template
    max_context: int

    @staticmethod
    def discover(url: str, name: str, tokenizer_dir: str | None = None) -> "ServedModel":
        """NAME as served at `url` (gRPC): its generate model NAME_generate, whose parameters
        give the tokenizer's directory (unless tokenizer_dir is given) and the largest context."""
        from pathlib import Path

        from .client import TlalocClient
        from ..repository import generate_model_name

        gen = generate_model_name(name)
        with TlalocClient(url, gen, "grpc") as c:
            params = c.model_parameters()
        directory = tokenizer_dir or params.get("tokenizer_dir")
        if not directory:
            raise ValueError(f"{gen} names no tokenizer directory: pass --tokenizer")
        return ServedModel(name, gen, ArtifactTokenizer(Path(directory)),
                           int(params["max_context"]))


@dataclass(frozen=True)
class ServerOptions:
    """What the server lets in (http_doors.py)."""
    api_key: str | None = field(default=None, repr=False)  # None: no key asked for
    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent: int = 64  # generations in flight; the one over is answered 429
    cors_origins: tuple[str, ...] = ()  # none: no CORS headers
    # None: derived from the bind host (for_host), loopback names if never bound
    allowed_hosts: tuple[str, ...] | None = None
    max_prompt_chars: int = 1_000_000  # a prompt, or the messages' content, over it is a 400
    # Slow clients: a request's headers must all come within header_timeout_s of the
    # connection opening (or of the answer before), its body within body_timeout_s of its
    # headers (408 otherwise); a connection idle keep_alive_s after an answer is closed.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_header_bytes: int = 16 * 1024  # a request line and headers over it are a 400 (h11)

    def __post_init__(self):
        for name in ("max_body_bytes", "max_concurrent", "max_prompt_chars", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be at least 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)}: must be above 0")

    def for_host(self, bind_host: str) -> "ServerOptions":
        """These options for a server bound to `bind_host`: allowed_hosts, if not given,
        derived from it (http_doors.default_allowed_hosts)."""
        if self.allowed_hosts is not None:
            return self
        return replace(self, allowed_hosts=default_allowed_hosts(bind_host))


# ------------------------------------------------------------------ request bodies

def _sampling(body: dict) -> dict:
    """The generate model's sampling_parameters from an OpenAI request body. Each value is
    passed on as sent once it has the JSON type its parameter takes: the generate model checks
    its range, and names it when it refuses (a 400)."""
    out = {"temperature": number(body, "temperature", 1.0), "top_p": number(body, "top_p", 1.0)}
    max_tokens = number(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = number(body, "max_tokens")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for key in ("seed", "top_k"):
        if (value := number(body, key)) is not None:
            out[key] = value
    stop = typed(body, "stop", (str, list), "a string or a list of strings")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop: a string or a list of strings, not {shown(stop)}")
    # Refused in both forms, as vLLM refuses them: an empty stop string would match at once,
    # which no client means (to stop at nothing, leave stop out).
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise APIError(400, "stop: an empty stop string (leave stop out for none)")
    if stop:
        out["stop"] = stop
    # vLLM's extension: prompts of different salts never share cached KV.
    if (salt := typed(body, "cache_salt", (str,), "a string")) is not None:
        out["cache_salt"] = salt
    # This server's extension: drafts verified in one call, e.g. {"method": "prompt_lookup",
    # "num_draft_tokens": 6} (checked by the generate model).
    if (speculative := typed(body, "speculative", (dict,), "a JSON object")) is not None:
        out["speculative"] = speculative
    if (structured := _structured_output(body)) is not None:
        out["structured_output"] = structured
    return out


# vLLM's older extension fields, each the structured_output kind it names.
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_output(body: dict) -> dict | None:
    """The structured_output sampling parameter a request asks for: OpenAI's
    response_format (json_object, json_schema), this server's structured_output extension or
    vLLM's guided_* fields; at most one of them. Their contents are checked by the generate
    model and the grammar compiler, which name what they refuse (a 400)."""
    asked = {}
    fmt = typed(body, "response_format", (dict,), "an object")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = typed(fmt, "json_schema", (dict,), "an object with name and schema",
                         "response_format.")
            if spec is None:
                raise APIError(400, "response_format.json_schema: required with type "
                                    "json_schema")
            schema = typed(spec, "schema", (dict,), "a JSON schema object",
                           "response_format.json_schema.")
            strict = typed(spec, "strict", (bool,), "true or false",
                           "response_format.json_schema.")
            # OpenAI's strict: every keyword enforced, or the request refused; not strict,
            # keywords the grammar engine lacks are left out.
            asked["response_format"] = {"json_schema": schema if schema is not None else {},
                                        "strict": bool(strict)}
        elif kind != "text":
            raise APIError(400, f"response_format.type: {shown(kind)} is not supported: one of "
                                f"text, json_object, json_schema")
    given = typed(body, "structured_output", (dict,), "a JSON object")
    if given is not None:
        asked["structured_output"] = given
    for field, kind in GUIDED_FIELDS.items():
        if (value := body.get(field)) is not None:
            if field == "guided_json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise APIError(400, "guided_json: not a JSON schema") from None
            asked[field] = {kind: value}
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)}: at most one constraint per request")
    return next(iter(asked.values()), None)


@dataclass
class GenerateCall:
    """One OpenAI request as the arguments of one request to its model's generate model."""
    model: ServedModel
    prompt_ids: list[int]
    sampling: dict
    stream: bool
    chat: bool  # /v1/chat/completions (else /v1/completions): the shape of the response
    include_usage: bool  # stream_options.include_usage: the last chunk carries the usage


def _served_model(models: dict[str, ServedModel], body: dict) -> ServedModel:
    """The model a request names (404 if it is not served), with n = 1 (the only n served)."""
    name = typed(body, "model", (str,), "a model's name")
    if name not in models:
        raise APIError(404, f"model {name!r} is not served here (served: {', '.join(models)})",
                       "not_found_error")
    n = typed(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise APIError(400, "n other than 1 is not supported")
    return models[name]


def _streaming(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a request body."""
    stream = typed(body, "stream", (bool,), "true or false")
    options = typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = typed(options, "include_usage", (bool,), "true or false", "stream_options.")
    return bool(stream), bool(include_usage)


def _too_long(what: str, length: int, max_chars: int, unit: str = "characters") -> APIError:
    return APIError(400, f"{what}: {length} {unit}, over the {max_chars} this server takes")


# Token ids go to the generate model as int32.
_MAX_TOKEN_ID = 2**31 - 1


def completion_call(models: dict[str, ServedModel], body: dict,
                    max_prompt_chars: int = ServerOptions.max_prompt_chars) -> GenerateCall:
    """POST /v1/completions: the prompt is one string or one list of token ids (either may
    come as a list of one); max_tokens defaults to 16."""
    model = _served_model(models, body)
    stream, include_usage = _streaming(body)
    sampling = {"max_tokens": 16, **_sampling(body)}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if len(prompt) > max_prompt_chars:
            raise _too_long("prompt", len(prompt), max_prompt_chars)
        ids = model.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and len(prompt) > max_prompt_chars:
        raise _too_long("prompt", len(prompt), max_prompt_chars, "token ids")
    elif isinstance(prompt, list) and all(
            type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in prompt):
        ids = list(prompt)
    else:
        raise APIError(400, f"prompt: one string or one list of token ids, not "
                            f"{shown(prompt)}")
    return GenerateCall(model, ids, sampling, stream, False, include_usage)


# The roles a chat template is given; any other would be rendered into it verbatim, a turn
# of the client's own naming.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages) -> list[dict]:
    """The request's messages as the chat template takes them: each an object with one of
    CHAT_ROLES, its content a string (its text parts joined with newlines, as vLLM joins them)
    or null. Anything else is a 400 naming the message."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages: a non-empty list, not {shown(messages)}")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise APIError(400, f"messages[{i}]: an object with role and content, not "
                            f"{shown(message)}")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise APIError(400, f"messages[{i}].role: {shown(role)} is not supported: one of "
                            f"{', '.join(CHAT_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": _text_of_parts(i, content)}
    if content is not None and not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content: a string or a list of parts, not "
                            f"{shown(content)}")
    return message


def _text_of_parts(i: int, parts: list) -> str:
    """A message's content parts, text only, as one text."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise APIError(400, f"{where}: a part object, not {shown(part)}")
        kind = part.get("type")
        if kind != "text":
            name = kind if isinstance(kind, str) else shown(kind)
            raise APIError(400, f"{where}: part type {name} is not supported: text only")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.text: a string, not {shown(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def _content_chars(messages: list[dict]) -> int:
    """The characters of the messages' content (chat_messages': strings or null)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def chat_call(models: dict[str, ServedModel], body: dict,
              max_prompt_chars: int = ServerOptions.max_prompt_chars) -> GenerateCall:
    """POST /v1/chat/completions: the messages rendered with the chat template; max_tokens
    defaults to what the largest context leaves after the prompt."""
    model = _served_model(models, body)
    stream, include_usage = _streaming(body)
    sampling = _sampling(body)
    messages = chat_messages(body.get("messages"))
    chars = _content_chars(messages)
    if chars > max_prompt_chars:
        raise _too_long("messages' content", chars, max_prompt_chars)
    try:
        ids = model.tokenizer.apply_chat_template(messages)
    except LiteralContentError as e:  # names the message itself
        raise APIError(400, str(e))
    except Exception as e:
        raise APIError(400, f"messages: the chat template failed: {e}")
    sampling.setdefault("max_tokens", max(1, model.max_context - len(ids)))
    return GenerateCall(model, ids, sampling, stream, True, include_usage)


# ------------------------------------------------------------------ generations

# How often a request waiting on its generation looks whether its client has gone.
DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """The client disconnected before its answer: its generation is cancelled."""


class Generation:
    """One generation on a worker thread of its own (generate blocks on its gRPC stream): its
    pieces of text (when streamed), then its GenerateResult or the exception generate raised,
    come in order on `items`, an asyncio queue of the event loop that started it. Setting
    `cancel` stops it; `release` (its slot's, idempotent) is called when it ends, however it
    ends, or when abandoned, whichever comes first."""

    def __init__(self, generate, url: str, call: GenerateCall, release):
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.release = release
        self._loop = asyncio.get_running_loop()
        self._args = (generate, url, call)
        threading.Thread(target=self._run, daemon=True, name="tlaloc-generation").start()

    def abandon(self) -> None:
        """Its client is gone (or the server stops): cancelled, and its slot given back now
        rather than when generate returns, which takes a step of the generate model or more
        (a slot held meanwhile refused other clients 429 under load)."""
        self.cancel.set()
        self.release()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped, no one waits
            pass

    def _run(self) -> None:
        generate, url, call = self._args
        try:
            try:
                item = generate(url, call.model.generate_model, input_ids=call.prompt_ids,
                                sampling=call.sampling, stream=call.stream,
                                on_text=self._put if call.stream else None, cancel=self.cancel)
            except Exception as e:  # answered as a 500 (a TimeoutError: 504)
                item = e
        finally:
            self.release()  # before the answer: a client that has it can start the next
        self._put(item)

    async def next_item(self, request: Request):
        """The next item, watching the client meanwhile: if it disconnects, the generation is
        cancelled and ClientGone raised. (Inside a streamed response starlette watches
        instead, cancelling the response's generator.)"""
        getter = asyncio.ensure_future(self.items.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    raise ClientGone
        except BaseException:  # the client gone, or this task cancelled (the server stops)
            self.abandon()
            raise
        finally:
            getter.cancel()


class GenerationStream(StreamingResponse):
    """A stream's response: its generation is abandoned however the response ends. The events'
    generator cannot see to it alone: starlette cancels the task sending the stream when the
    client goes, and a generator cancelled before it first ran, or while the chunk it yielded
    was being sent, does not run its `finally` then."""

    def __init__(self, content, generation: Generation):
        super().__init__(content, media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # after a whole stream: the generation has ended and released already
            self.generation.abandon()


# ------------------------------------------------------------------ routes

router = APIRouter()


async def _generation(request: Request, parse) -> Response:
    """Every generation request passes here: a slot taken (429 if none is free), its body
    parsed into a GenerateCall by `parse` and its prompt tokenized off the event loop, the
    generation started; then answered once it ends (a JSON body) or its first piece comes (a
    stream), so that an error at the start is answered with its HTTP status."""
    state = request.app.state
    release = state.slots.take()
    try:
        raw = await request.body()
        call = await run_in_threadpool(
            lambda: parse(state.models, parse_body(raw), state.options.max_prompt_chars))
        generation = Generation(state.generate, state.url, call, release)
    except BaseException:
        release()  # no generation started to release it
        raise
    try:
        first = await generation.next_item(request)
    except ClientGone:
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    if not isinstance(first, str) and (error := refusal(first)) is not None:
        raise error
    reply = Reply.to(call)
    if call.stream:
        return GenerationStream(events(reply, generation, first), generation)
    return JSONResponse(completion_body(reply, first))


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "triton-tlaloc"}
        for name in request.app.state.models]}


@router.post("/v1/completions")
async def completions(request: Request):
    return await _generation(request, completion_call)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _generation(request, chat_call)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def make_app(url: str, models: dict[str, ServedModel], *,
             options: ServerOptions = ServerOptions(), generate=grpc_generate) -> FastAPI:
    """The server's app: `models` (by the names clients use), generated by their generate
    models at `url` (tritonserver's gRPC address) through `generate` (client.generate's
    signature and GenerateResult), behind the doors `options` set. Options whose allowed_hosts
    is None accept the loopback names only: give serve's options.for_host(host) otherwise."""
    app = FastAPI(title="triton-tlaloc OpenAI-compatible server")
    app.state.url = url
    app.state.models = models
    app.state.options = options
    app.state.generate = generate
    app.state.slots = GenerationSlots(options.max_concurrent)
    app.add_exception_handler(APIError, _api_error)
    app.include_router(router)
    add_doors(app, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
              cors_origins=options.cors_origins,
              allowed_hosts=options.for_host("127.0.0.1").allowed_hosts,
              body_timeout_s=options.body_timeout_s)
    return app


def uvicorn_settings(options: ServerOptions) -> dict:
    """uvicorn's settings for slow clients: h11 (the protocol whose headers get a deadline,
    http_doors.guarded_h11_protocol) whether or not httptools is installed, its keep-alive
    timeout and largest request head."""
    return dict(http=guarded_h11_protocol(options.header_timeout_s),
                timeout_keep_alive=options.keep_alive_s,
                h11_max_incomplete_event_size=options.max_header_bytes)


def serve_in_thread(url: str, models: dict[str, ServedModel], *,
                    options: ServerOptions = ServerOptions(), generate=grpc_generate):
    """The server on a free loopback port in a thread of this process (tests, verify.sh):
    returns (its /v1 base URL, a function that stops it)."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = make_app(url, models, options=options.for_host("127.0.0.1"), generate=generate)
    front = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                          **uvicorn_settings(options)))
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    while not front.started:
        if not thread.is_alive():
            raise RuntimeError(f"the OpenAI server did not start on 127.0.0.1:{port}")
        time.sleep(0.02)

    def stop():
        front.should_exit = True
        thread.join(10)
    return f"http://127.0.0.1:{port}/v1", stop


def serve(url: str, models: dict[str, ServedModel], host: str = "127.0.0.1",
          port: int = 8000, *, options: ServerOptions = ServerOptions(),
          generate=grpc_generate) -> None:
    import uvicorn

    app = make_app(url, models, options=options.for_host(host), generate=generate)
    uvicorn.run(app, host=host, port=port, log_level="info", **uvicorn_settings(options))

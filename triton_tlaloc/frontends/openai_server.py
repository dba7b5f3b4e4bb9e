"""`tlaloc openai`: an OpenAI-compatible HTTP server in front of a generate model.

    GET  /v1/models              each model's name and max_model_len
    POST /v1/completions         prompt (text or token ids)
    POST /v1/chat/completions    messages, rendered with the artifact's chat template
    GET  /health, POST /tokenize, POST /detokenize (openai_utility.py)

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
import threading
import time
from dataclasses import dataclass, field, replace

# at module level: FastAPI resolves the annotations here
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .client import generate as grpc_generate
from .openai_requests import (MAX_PROMPT_CHARS, GenerateCall, ServedModel, chat_call,
                              completion_call)
from .openai_responses import Reply, choice_events, completion_body, refusal
from .openai_utility import grpc_ready
from .openai_adapters import router as adapters_router
from .openai_adapters import send_admin
from .openai_utility import router as utility_router
from .http_doors import (APIError, GenerationSlots, add_doors, default_allowed_hosts,
                         guarded_h11_protocol, parse_body)


@dataclass(frozen=True)
class ServerOptions:
    """What the server lets in (http_doors.py)."""
    api_key: str | None = field(default=None, repr=False)  # None: no key asked for
    # the key of the routes that load and unload adapters (openai_adapters.py); None: closed
    admin_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent: int = 64  # generations in flight; the one over is answered 429
    cors_origins: tuple[str, ...] = ()  # none: no CORS headers
    # None: derived from the bind host (for_host), loopback names if never bound
    allowed_hosts: tuple[str, ...] | None = None
    max_prompt_chars: int = MAX_PROMPT_CHARS  # a prompt, or the messages' content, over it is a 400
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

    def __init__(self, generate, url: str, call: GenerateCall, release, index: int = 0):
        """Choice `index` of the call (its own seed). Its pieces always come, whether or not
        the client streams: the generate model answers a generation it does not stream only
        at its end, and the wait for a response (generate's 120 s) would then bound the whole
        generation's length rather than the time between its tokens."""
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.release = release
        self._loop = asyncio.get_running_loop()
        self._args = (generate, url, call, index, True)
        self._looked = time.monotonic()  # when next_item last looked at the client
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
        generate, url, call, index, stream = self._args
        try:
            try:
                item = generate(url, call.model.generate_model, input_ids=call.prompt_ids,
                                sampling=call.choice_sampling(index), stream=stream,
                                on_text=self._put if stream else None, cancel=self.cancel)
            except Exception as e:  # answered as a 500 (a TimeoutError: 504)
                item = e
        finally:
            self.release()  # before the answer: a client that has it can start the next
        self._put(item)

    async def next_item(self, request: Request):
        """The next item, watching the client meanwhile: if it disconnects, the generation is
        cancelled and ClientGone raised. The client is looked at every DISCONNECT_POLL_S by
        the clock, whether items come or not: a choice streamed inside a whole completion
        hands over a piece a token, and looking only when none came for a poll's time never
        looked while it ran. (Inside a streamed response starlette watches instead,
        cancelling the response's generator.)"""
        getter = asyncio.ensure_future(self.items.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                now = time.monotonic()
                if now - self._looked >= DISCONNECT_POLL_S:
                    self._looked = now
                    if await request.is_disconnected():
                        raise ClientGone
                if done:
                    return getter.result()
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

    def __init__(self, content, generation: "Generation | Generations"):
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
    """Every generation request passes here: a slot taken for each choice (429 if one is not
    free), its body parsed into a GenerateCall by `parse` and its prompt tokenized off the
    event loop, the generations started; then answered once they end (a JSON body) or their
    first pieces come (a stream), so that an error at the start is answered with its HTTP
    status. With n > 1 choice 0 starts first and the others once it has its first token: its
    prompt's blocks are then registered, and the others reuse them rather than compute the
    prompt again."""
    state = request.app.state
    releases = [state.slots.take()]
    try:
        raw = await request.body()
        call = await run_in_threadpool(
            lambda: parse(state.models, parse_body(raw), state.options.max_prompt_chars))
        for _ in range(call.n - 1):  # one at a time: a 429 at the last gives back the rest
            releases.append(state.slots.take())
        generations = [Generation(state.generate, state.url, call, releases[0])]
    except BaseException:
        for release in releases:
            release()  # no generation started to release it
        raise
    firsts = []
    try:
        for i in range(call.n):
            if i == 1:  # choice 0 has its first token: its prompt is computed
                generations += [Generation(state.generate, state.url, call, releases[j], j)
                                for j in range(1, call.n)]
            firsts.append(await generations[i].next_item(request))
            if not isinstance(firsts[-1], str) and (error := refusal(firsts[-1])) is not None:
                raise error
    except BaseException as e:
        for g in generations:
            g.abandon()
        for release in releases[len(generations):]:
            release()
        if isinstance(e, ClientGone):
            return Response(status_code=499)  # nginx's "client closed request"
        raise
    reply = Reply.to(call)
    if call.stream:
        together = Generations(generations)
        return GenerationStream(choice_events(reply, generations, firsts), together)
    try:
        results = [await _result(g, first, request) for g, first in zip(generations, firsts)]
    except BaseException as e:  # the client gone, or the server stopping: none goes on
        for g in generations:
            g.abandon()
        if isinstance(e, ClientGone):
            return Response(status_code=499)
        raise
    for got in results:
        if (error := refusal(got)) is not None:
            raise error
    return JSONResponse(completion_body(reply, *results))


async def _result(generation: Generation, item, request: Request):
    """A generation's outcome, its pieces (choice 0 of n streams them) passed over."""
    while isinstance(item, str):
        item = await generation.next_item(request)
    return item


class Generations:
    """The choices of one request, abandoned together."""

    def __init__(self, generations: list[Generation]):
        self.generations = generations

    def abandon(self) -> None:
        for g in self.generations:
            g.abandon()


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "triton-tlaloc",
         "root": name, "parent": m.parent, "max_model_len": m.max_context}
        for name, m in request.app.state.models.items()]}


@router.post("/v1/completions")
async def completions(request: Request):
    return await _generation(request, completion_call)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _generation(request, chat_call)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def make_app(url: str, models: dict[str, ServedModel], *,
             options: ServerOptions = ServerOptions(), generate=grpc_generate,
             ready=grpc_ready, admin=send_admin) -> FastAPI:
    """The server's app: `models` (by the names clients use), generated by their generate
    models at `url` (tritonserver's gRPC address) through `generate` (client.generate's
    signature and GenerateResult), behind the doors `options` set; `ready(url, generate_model)`
    answers /health. Options whose allowed_hosts
    is None accept the loopback names only: give serve's options.for_host(host) otherwise."""
    app = FastAPI(title="triton-tlaloc OpenAI-compatible server")
    app.state.url = url
    app.state.models = models
    app.state.options = options
    app.state.generate = generate
    app.state.ready = ready  # ready(url, generate_model): /health
    app.state.slots = GenerationSlots(options.max_concurrent)
    app.add_exception_handler(APIError, _api_error)
    app.include_router(router)
    app.include_router(utility_router)
    app.include_router(adapters_router)
    app.state.send_admin = admin  # admin(url, model, command, key): an adapter load or unload
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
                    options: ServerOptions = ServerOptions(), generate=grpc_generate,
                    ready=grpc_ready, admin=send_admin):
    """The server on a free loopback port in a thread of this process (tests, verify.sh):
    returns (its /v1 base URL, a function that stops it)."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = make_app(url, models, options=options.for_host("127.0.0.1"), generate=generate,
                   ready=ready, admin=admin)
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

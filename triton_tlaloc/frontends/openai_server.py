"""`tlaloc openai`: an OpenAI-compatible HTTP server in front of a generate model.

    GET  /v1/models
    POST /v1/completions         prompt (text or token ids)
    POST /v1/chat/completions    messages, rendered with the artifact's chat template

`stream: true` answers with server-sent events (`data: {chunk}` lines, then `data: [DONE]`).
Each request becomes one request to NAME_generate over a gRPC stream (client.generate); a
client that disconnects mid-stream cancels it, which ends the sequence and frees its pages.
Built on FastAPI and uvicorn, as vllm's OpenAI server is. Sampling follows the OpenAI API's
defaults (temperature 1, top_p 1, max_tokens 16 for completions; a chat completion runs to the
end of the sequence or the largest context unless max_tokens says otherwise).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass

# at module level: FastAPI resolves the annotations here
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .client import GenerateResult, generate
from .tokenizer import ArtifactTokenizer


@dataclass
class ServedModel:
    name: str  # the name clients use: the sequence model's
    generate_model: str
    tokenizer: ArtifactTokenizer
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


def _sampling(body: dict, default_max_tokens: int | None) -> dict:
    """The generate model's sampling_parameters from an OpenAI request body."""
    def given(key, default):
        return default if body.get(key) is None else body[key]

    out = {"temperature": float(given("temperature", 1.0)), "top_p": float(given("top_p", 1.0))}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    if max_tokens is not None:
        out["max_tokens"] = int(max_tokens)
    for key in ("seed", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop"):
        out["stop"] = body["stop"]
    return out


class APIError(Exception):
    """A request the server refuses: answered with OpenAI's error object and `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "code": self.status}}, status_code=self.status)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


# ------------------------------------------------------------------ requests

@dataclass
class GenerateCall:
    """One OpenAI request as the arguments of one request to its model's generate model."""
    model: ServedModel
    prompt_ids: list[int]
    sampling: dict
    stream: bool
    chat: bool  # /v1/chat/completions (else /v1/completions): the shape of the response
    body: dict  # the request as sent; its stream_options are read when the stream ends

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))


def _served_model(models: dict[str, ServedModel], body: dict) -> ServedModel:
    """The model a request names (404 if it is not served), with n = 1 (the only n served)."""
    name = body.get("model")
    if name not in models:
        raise APIError(404, f"model {name!r} is not served here (served: {', '.join(models)})",
                       "not_found_error")
    if int(body.get("n") or 1) != 1:
        raise APIError(400, "n other than 1 is not supported")
    return models[name]


def completion_call(models: dict[str, ServedModel], body: dict) -> GenerateCall:
    """POST /v1/completions: the prompt is one string or one list of token ids (either may
    come as a list of one); max_tokens defaults to 16."""
    model = _served_model(models, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise APIError(400, "prompt: one string or one list of token ids")
    return GenerateCall(model, ids, _sampling(body, 16), bool(body.get("stream")), False, body)


def chat_call(models: dict[str, ServedModel], body: dict) -> GenerateCall:
    """POST /v1/chat/completions: the messages rendered with the chat template; max_tokens
    defaults to what the largest context leaves after the prompt."""
    model = _served_model(models, body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list")
    try:
        ids = model.tokenizer.apply_chat_template(messages)
    except Exception as e:
        raise APIError(400, f"messages: the chat template failed: {e}")
    return GenerateCall(model, ids, _sampling(body, max(1, model.max_context - len(ids))),
                        bool(body.get("stream")), True, body)


# ------------------------------------------------------------------ responses

def _choice(chat: bool, text: str | None, finish, delta: bool, first: bool = False) -> dict:
    """choices[0] of a response (delta: of a streamed chunk; first: the stream's first)."""
    if chat:
        if delta:
            d = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            return {"index": 0, "delta": d, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


def _usage(got: GenerateResult) -> dict:
    return {"prompt_tokens": got.prompt_tokens, "completion_tokens": got.completion_tokens,
            "total_tokens": got.prompt_tokens + got.completion_tokens}


@dataclass
class _Reply:
    """What every response (and every chunk of a stream) to one request carries."""
    call: GenerateCall
    id: str
    created: int

    def body(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.call.model.name, "choices": [choice]}


def answer(url: str, call: GenerateCall):
    """The response to `call`, generated by the generate models at `url` (gRPC): a JSON body,
    or server-sent events when call.stream. Blocks until the generation ends (a JSON body) or
    has started (a stream): run it off the event loop."""
    reply = _Reply(call, f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}",
                   int(time.time()))
    if call.stream:
        return _streaming_response(url, reply)
    return _completion_body(url, reply)


def _completion_body(url: str, reply: _Reply) -> dict:
    """The whole completion in one JSON body (400 if the generate model refuses)."""
    call = reply.call
    got = generate(url, call.model.generate_model, input_ids=call.prompt_ids,
                   sampling=call.sampling, stream=False)
    if got.error is not None:
        raise APIError(400, got.error)
    obj = "chat.completion" if call.chat else "text_completion"
    return {**reply.body(obj, _choice(call.chat, got.text, got.finish_reason, False)),
            "usage": _usage(got)}


def _generate_in_thread(url: str, call: GenerateCall) -> tuple[queue.Queue, threading.Event]:
    """The generation on a thread of its own: the queue gets each new piece of text as it
    comes, then the GenerateResult or the exception raised; setting the event cancels it."""
    pieces: queue.Queue = queue.Queue()
    cancel = threading.Event()

    def worker():
        try:
            got = generate(url, call.model.generate_model, input_ids=call.prompt_ids,
                           sampling=call.sampling, on_text=pieces.put, cancel=cancel)
            pieces.put(got)
        except Exception as e:  # reported to the client as an error event
            pieces.put(e)

    threading.Thread(target=worker, daemon=True).start()
    return pieces, cancel


def _streaming_response(url: str, reply: _Reply) -> StreamingResponse:
    pieces, cancel = _generate_in_thread(url, reply.call)
    return StreamingResponse(_events(reply, pieces, cancel), media_type="text/event-stream")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _events(reply: _Reply, pieces: queue.Queue, cancel: threading.Event):
    """The stream's events: a chunk per piece of text, a last chunk with the finish reason
    (and the usage if stream_options.include_usage), or an error event; then [DONE]."""
    chat = reply.call.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = True
    try:
        while True:
            item = pieces.get()
            if isinstance(item, Exception) or (not isinstance(item, str)
                                               and item.error is not None):
                msg = str(item) if isinstance(item, Exception) else item.error
                yield _sse({"error": {"message": msg}})
                break
            if isinstance(item, str):
                if not item and not first:
                    continue
                chunk = reply.body(obj, _choice(chat, item, None, True, first))
                first = False
                yield _sse(chunk)
                continue
            chunk = reply.body(obj, _choice(chat, None, item.finish_reason, True, first))
            if reply.call.include_usage:
                chunk["usage"] = _usage(item)
            yield _sse(chunk)
            break
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # a client gone mid-stream: the generation is cancelled


# ------------------------------------------------------------------ routes

router = APIRouter()


async def _generation(request: Request, parse):
    """Every generation request passes here: its body parsed into a GenerateCall by `parse`,
    then answered off the event loop (answer blocks on the gRPC stream), so that requests
    run concurrently."""
    state = request.app.state
    call = parse(state.models, await request.json())
    return await run_in_threadpool(answer, state.url, call)


@router.get("/v1/models")
def list_models(request: Request):
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "triton-tlaloc"}
        for name in request.app.state.models]}


@router.post("/v1/completions")
async def completions(request: Request):
    return await _generation(request, completion_call)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _generation(request, chat_call)


def make_app(url: str, models: dict[str, ServedModel]) -> FastAPI:
    """The server's app: `models` (by the names clients use), generated by their generate
    models at `url` (tritonserver's gRPC address)."""
    app = FastAPI(title="triton-tlaloc OpenAI-compatible server")
    app.state.url = url
    app.state.models = models
    app.add_exception_handler(APIError, _api_error)
    app.include_router(router)
    return app


def serve_in_thread(url: str, models: dict[str, ServedModel]):
    """The server on a free loopback port in a thread of this process (tests, verify.sh):
    returns (its /v1 base URL, a function that stops it)."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    front = uvicorn.Server(uvicorn.Config(make_app(url, models), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    while not front.started:
        time.sleep(0.05)

    def stop():
        front.should_exit = True
        thread.join(10)
    return f"http://127.0.0.1:{port}/v1", stop


def serve(url: str, models: dict[str, ServedModel], host: str = "127.0.0.1",
          port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(make_app(url, models), host=host, port=port, log_level="info")

"""`tlaloc openai`: an OpenAI-compatible HTTP server in front of a generate model (issue 9).

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

from fastapi import FastAPI, Request  # at module level: FastAPI resolves the annotations here
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .client import generate
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


def make_app(url: str, models: dict[str, ServedModel]):
    app = FastAPI(title="triton-tlaloc OpenAI-compatible server")

    def error(status: int, message: str, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status)

    @app.get("/v1/models")
    def list_models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "triton-tlaloc"}
            for name in models]}

    def run(model: ServedModel, prompt_ids: list[int], sampling: dict, stream: bool,
            kind: str, body: dict):
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(text: str | None, finish, delta: bool, first: bool = False):
            if kind == "chat":
                if delta:
                    d = {"role": "assistant", "content": text or ""} if first else (
                        {"content": text} if text else {})
                    return {"index": 0, "delta": d, "finish_reason": finish}
                return {"index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if not stream:
            got = generate(url, model.generate_model, input_ids=prompt_ids, sampling=sampling,
                           stream=False)
            if got.error is not None:
                return error(400, got.error)
            return {"id": rid, "object": obj, "created": created, "model": model.name,
                    "choices": [choice(got.text, got.finish_reason, False)],
                    "usage": {"prompt_tokens": got.prompt_tokens,
                              "completion_tokens": got.completion_tokens,
                              "total_tokens": got.prompt_tokens + got.completion_tokens}}

        pieces: queue.Queue = queue.Queue()
        cancel = threading.Event()

        def worker():
            try:
                got = generate(url, model.generate_model, input_ids=prompt_ids,
                               sampling=sampling, on_text=pieces.put, cancel=cancel)
                pieces.put(got)
            except Exception as e:  # reported to the client as an error event
                pieces.put(e)

        threading.Thread(target=worker, daemon=True).start()
        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def events():
            first = True
            try:
                while True:
                    item = pieces.get()
                    if isinstance(item, Exception) or (not isinstance(item, str)
                                                       and item.error is not None):
                        msg = str(item) if isinstance(item, Exception) else item.error
                        yield f"data: {json.dumps({'error': {'message': msg}})}\n\n"
                        break
                    if isinstance(item, str):
                        if not item and not first:
                            continue
                        chunk = {"id": rid, "object": chunk_obj, "created": created,
                                 "model": model.name, "choices": [choice(item, None, True, first)]}
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                        continue
                    chunk = {"id": rid, "object": chunk_obj, "created": created,
                             "model": model.name,
                             "choices": [choice(None, item.finish_reason, True, first)]}
                    if (body.get("stream_options") or {}).get("include_usage"):
                        chunk["usage"] = {"prompt_tokens": item.prompt_tokens,
                                          "completion_tokens": item.completion_tokens,
                                          "total_tokens": item.prompt_tokens
                                          + item.completion_tokens}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    break
                yield "data: [DONE]\n\n"
            finally:
                cancel.set()  # a client gone mid-stream: the generation is cancelled

        return StreamingResponse(events(), media_type="text/event-stream")

    def served(body: dict):
        name = body.get("model")
        if name not in models:
            return None, error(404, f"model {name!r} is not served here (served: "
                                    f"{', '.join(models)})", "not_found_error")
        if int(body.get("n") or 1) != 1:
            return None, error(400, "n other than 1 is not supported")
        return models[name], None

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        model, err = served(body)
        if err is not None:
            return err
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = model.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            return error(400, "prompt: one string or one list of token ids")
        # run blocks on the gRPC stream: off the event loop, so requests run concurrently
        return await run_in_threadpool(run, model, ids, _sampling(body, 16),
                                       bool(body.get("stream")), "text", body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await request.json()
        model, err = served(body)
        if err is not None:
            return err
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return error(400, "messages: a non-empty list")
        try:
            ids = model.tokenizer.apply_chat_template(messages)
        except Exception as e:
            return error(400, f"messages: the chat template failed: {e}")
        return await run_in_threadpool(run, model, ids,
                                       _sampling(body, max(1, model.max_context - len(ids))),
                                       bool(body.get("stream")), "chat", body)

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

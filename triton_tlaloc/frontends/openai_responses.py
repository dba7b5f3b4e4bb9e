"""What `tlaloc openai` answers: a completion's JSON body, a stream's server-sent events, and
the HTTP status a generation's failure is answered with (the generate model's gRPC status kept:
a bad request 400, a full pool 503)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .client import GenerateResult
from .http_doors import APIError

if TYPE_CHECKING:
    from .openai_server import GenerateCall, Generation

# What a generate model's refusal (its gRPC status) is over HTTP; any other is a 500.
HTTP_OF_GRPC_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "RESOURCE_EXHAUSTED": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


def refusal(item) -> APIError | None:
    """The error a generation's outcome (a GenerateResult, or the exception generate raised)
    is answered with, or None when it succeeded."""
    if isinstance(item, TimeoutError):  # generate's own wait for a response ran out
        return APIError(504, f"the generation timed out: {item}", "timeout")
    if isinstance(item, Exception):
        return APIError(500, f"the generation failed: {item}", "server_error")
    if item.error is None:
        return None
    status, kind = HTTP_OF_GRPC_STATUS.get(item.status, (500, "server_error"))
    return APIError(status, item.error, kind)


def choice(chat: bool, text: str | None, finish, delta: bool, first: bool = False) -> dict:
    """choices[0] of a response (delta: of a streamed chunk; first: the stream's first)."""
    if chat:
        if delta:
            d = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            return {"index": 0, "delta": d, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


def usage(got: GenerateResult) -> dict:
    return {"prompt_tokens": got.prompt_tokens, "completion_tokens": got.completion_tokens,
            "total_tokens": got.prompt_tokens + got.completion_tokens}


@dataclass
class Reply:
    """What every response (and every chunk of a stream) to one request carries."""
    call: GenerateCall
    id: str
    created: int

    @staticmethod
    def to(call: GenerateCall) -> "Reply":
        return Reply(call, f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}",
                      int(time.time()))

    def body(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.call.model.name, "choices": [choice]}


def completion_body(reply: Reply, got: GenerateResult) -> dict:
    call = reply.call
    obj = "chat.completion" if call.chat else "text_completion"
    return {**reply.body(obj, choice(call.chat, got.text, got.finish_reason, False)),
            "usage": usage(got)}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def events(reply: Reply, generation: Generation, item):
    """The stream's events from its first item on: a chunk per piece of text, a last chunk
    with the finish reason (and the usage if stream_options.include_usage), or an error event
    (its code the HTTP status the error would have had); then [DONE]. When the client
    disconnects, the response sending these (openai_server.GenerationStream) abandons the
    generation."""
    chat = reply.call.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = True
    while isinstance(item, str):
        if item or first:
            yield sse(reply.body(obj, choice(chat, item, None, True, first)))
            first = False
        item = await generation.items.get()
    error = refusal(item)
    if error is not None:
        yield sse(error.payload())
    else:
        chunk = reply.body(obj, choice(chat, None, item.finish_reason, True, first))
        if reply.call.include_usage:
            chunk["usage"] = usage(item)
        yield sse(chunk)
    yield "data: [DONE]\n\n"

"""What `tlaloc openai` answers: a completion's JSON body, a stream's server-sent events, and
the HTTP status a generation's failure is answered with (the generate model's gRPC status kept:
a bad request 400, a full pool 503)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..codes import GRPC_STATUS, split_coded_message
from .client import GenerateResult
from . import reasoning
from .http_doors import APIError
from .tool_calls import ToolCallStream

if TYPE_CHECKING:
    from .openai_requests import GenerateCall
    from .openai_server import Generation

# What a generate model's refusal (its gRPC status) is over HTTP; any other is a 500.
HTTP_OF_GRPC_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "RESOURCE_EXHAUSTED": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


# Triton puts this before a failed request's message when the request has an id
_REQUEST_ID = re.compile(r"^\[request id: [^\]]*\] ")


def failure_error(message: str, status: str | None) -> APIError:
    """What a model's failure is answered with: the code its message names in brackets at its
    start (codes.coded_message; after Triton's "[request id: ...] " when there is one), else
    the gRPC status name the error carries (status: "INTERNAL", "StatusCode.INTERNAL").
    INVALID_ARGUMENT is a 400, UNAVAILABLE a 503, DEADLINE_EXCEEDED a 504; anything else
    (INTERNAL, UNKNOWN, no code at all) is the server's failure: a 500 server_error."""
    code, _ = split_coded_message(_REQUEST_ID.sub("", message))
    name = GRPC_STATUS[code] if code is not None else (
        None if status is None else str(status).rsplit(".", 1)[-1])
    http, kind = HTTP_OF_GRPC_STATUS.get(name, (500, "server_error"))
    return APIError(http, message, kind)


def refusal(item) -> APIError | None:
    """The error a generation's outcome (a GenerateResult, or the exception generate raised)
    is answered with, or None when it succeeded."""
    if isinstance(item, TimeoutError):  # generate's own wait for a response ran out
        return APIError(504, f"the generation timed out: {item}", "timeout")
    if isinstance(item, Exception):
        return APIError(500, f"the generation failed: {item}", "server_error")
    if item.error is None:
        return None
    return failure_error(item.error, item.status)


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


def chat_message(call: GenerateCall, got: GenerateResult) -> dict:
    """choices[0] of a whole chat completion: its text, or its reasoning and the answer after
    it, and the tool calls read from the answer (finish_reason tool_calls)."""
    thought, content = None, got.text
    if call.reasoning is not None:
        thought, content = reasoning.split(call.reasoning, got.text)
    calls = []
    if call.tools is not None and content is not None:
        content, calls = call.tools.calls(content)
    message = {"role": "assistant", "content": content}
    if thought is not None:
        message["reasoning_content"] = thought
    finish = got.finish_reason
    if calls:
        message["tool_calls"] = [c.as_dict() for c in calls]
        finish = "tool_calls" if finish == "stop" else finish
    return {"index": 0, "message": message, "finish_reason": finish}


def logprobs_body(call: GenerateCall, ids: list[int], entries: list | None) -> dict | None:
    """choices[0].logprobs of `ids` (the tokens a response or a chunk carries) from the
    generate model's entries ([log-probability, [[id, log-probability], ...]] a token; None
    for an echoed prompt's first token): a chat's {"content": [...]}, a completion's
    {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; None when the request asked
    for none."""
    if entries is None or "logprobs" not in call.sampling:
        return None
    text = call.model.tokenizer.token_text
    if call.chat:
        def item(token: int, lp: float) -> dict:
            t = text(token)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}
        return {"content": [{**item(token, lp), "top_logprobs": [item(i, v) for i, v in top]}
                            for token, (lp, top) in zip(ids, entries)]}
    tokens = [text(t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else {text(i): v for i, v in e[1]}
                             for e in entries],
            "text_offset": offsets}


def prompt_logprobs_body(call: GenerateCall, entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: for each prompt token (None for the first) an object of token
    id: {logprob, rank, decoded_token}, the prompt token's and the most likely ones'."""
    if entries is None:
        return None
    text = call.model.tokenizer.token_text
    out = [None]
    for token, entry in zip(call.prompt_ids[1:], entries[1:]):
        lp, top, rank = entry
        at = {str(i): {"logprob": v, "rank": r, "decoded_token": text(i)}
              for r, (i, v) in enumerate(top[:call.prompt_top], 1)}
        at[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": text(token)}
        out.append(at)
    return out


def _echoed(call: GenerateCall, got: GenerateResult, prompt_entries: list | None
            ) -> tuple[list[int], list | None]:
    """The ids and logprob entries a completion's logprobs cover: with echo, the prompt's
    first (their most likely cut to the request's logprobs)."""
    if call.echo is None or got.logprobs is None or prompt_entries is None:
        return got.token_ids, got.logprobs
    k = call.sampling["logprobs"]
    prompt = [None if e is None else [e[0], e[1][:k]] for e in prompt_entries]
    return call.prompt_ids + got.token_ids, prompt + got.logprobs


def usage(*results: GenerateResult) -> dict:
    prompt = results[0].prompt_tokens
    completion = sum(got.completion_tokens for got in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


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


def completion_body(reply: Reply, *results: GenerateResult) -> dict:
    """The whole response: a choice for each result, by index; the usage counts the prompt
    once and every choice's tokens."""
    call = reply.call
    prompt_entries = results[0].prompt_logprobs  # choice 0's: the others share its prompt
    prompt_body = (prompt_logprobs_body(call, prompt_entries) if call.prompt_top is not None
                   else None)
    choices = []
    for i, got in enumerate(results):
        c = (chat_message(call, got) if call.chat else
             choice(False, (call.echo or "") + got.text, got.finish_reason, False))
        if (lp := logprobs_body(call, *_echoed(call, got, prompt_entries))) is not None:
            c["logprobs"] = lp
        if prompt_body is not None and not call.chat:  # vLLM: a completion's choice's
            c["prompt_logprobs"] = prompt_body
        if call.token_ids:  # vLLM: a completion's choice carries its prompt's ids too
            c.update({} if call.chat else {"prompt_token_ids": call.prompt_ids},
                     token_ids=got.token_ids)
        choices.append({**c, "index": i})
    obj = "chat.completion" if call.chat else "text_completion"
    body = {**reply.body(obj, choices[0]), "choices": choices, "usage": usage(*results)}
    if prompt_body is not None and call.chat:  # vLLM: a chat completion's own
        body["prompt_logprobs"] = prompt_body
    if call.token_ids and call.chat:
        body["prompt_token_ids"] = call.prompt_ids
    return body


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ChatDeltas:
    """A streamed chat answer's pieces as the deltas of its chunks: its reasoning as
    reasoning_content (reasoning.ReasoningStream), the answer as content or, with tools, as
    ToolCallStream makes it."""

    def __init__(self, call: GenerateCall):
        self.reasoning = (reasoning.ReasoningStream(call.reasoning)
                          if call.reasoning is not None else None)
        self.tools = ToolCallStream(call.tools) if call.tools is not None else None
        self.answer = []  # the content's text so far (the tool calls are read from it)

    def _answer(self, text: str) -> list[dict]:
        self.answer.append(text)
        if self.tools is not None:
            return self.tools.push(text)
        return [{"content": text}] if text else []

    def _parts(self, parts) -> list[dict]:
        out = []
        for kind, text in parts:
            out += [{kind: text}] if kind == "reasoning_content" else self._answer(text)
        return out

    def push(self, piece: str) -> list[dict]:
        if self.reasoning is None:
            return self._answer(piece)
        return self._parts(self.reasoning.push(piece))

    def end(self) -> list[dict]:
        out = self._parts(self.reasoning.end()) if self.reasoning is not None else []
        if self.tools is not None:
            out += self.tools.end("".join(self.answer))
        return out

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called


async def choice_events(reply: Reply, generations: list[Generation], firsts: list):
    """A stream of n choices: each choice's chunks (events, by its index) as they come, then
    one usage chunk if stream_options.include_usage (the prompt once, every choice's tokens)
    and [DONE]."""
    if len(generations) == 1:
        async for chunk in events(reply, generations[0], firsts[0]):
            yield chunk
        return
    merged: asyncio.Queue = asyncio.Queue()
    ended: list[GenerateResult] = []

    async def pump(i: int) -> None:
        try:
            async for chunk in events(reply, generations[i], firsts[i], i, ended):
                await merged.put(chunk)
        finally:
            await merged.put(None)
    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(generations))]
    try:
        left = len(tasks)
        while left:
            chunk = await merged.get()
            if chunk is None:
                left -= 1
            else:
                yield chunk
        if reply.call.include_usage and len(ended) == len(generations):
            obj = "chat.completion.chunk" if reply.call.chat else "text_completion"
            yield sse({**reply.body(obj, {}), "choices": [], "usage": usage(*ended)})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


async def events(reply: Reply, generation: Generation, item, index: int | None = None,
                 ended: list | None = None):
    """The stream's events from its first item on: a chunk per piece of text (a chat's with
    reasoning or tools: the deltas ChatDeltas makes of it), a last chunk with the finish reason
    (and the usage if stream_options.include_usage), or an error event (its code the HTTP
    status the error would have had); then [DONE]. When the client disconnects, the response
    sending these (openai_server.GenerationStream) abandons the generation. `index`: the
    choice's, one of n (its final chunk then carries no usage, its outcome goes to `ended`,
    and no [DONE] follows: choice_events sends them)."""
    call = reply.call
    chat = call.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    deltas = ChatDeltas(call) if call.tools is not None or call.reasoning is not None else None
    first = True

    def chunk_of(body: dict, token_ids=None) -> dict:
        if index is not None:
            body["index"] = index
        out = reply.body(obj, body)
        if call.token_ids and token_ids is not None:  # vLLM's return_token_ids
            body["token_ids"] = list(token_ids)
            if first:  # the prompt's with the first chunk: a chat's own, a completion's choice's
                (out if chat else body)["prompt_token_ids"] = call.prompt_ids
        return out

    def delta_chunk(delta: dict, logprobs: dict | None = None, token_ids=None) -> str:
        nonlocal first
        body = {"index": 0, "delta": ({"role": "assistant", "content": None, **delta} if first
                                      else delta), "finish_reason": None}
        if logprobs is not None:
            body["logprobs"] = logprobs
        chunk, first = chunk_of(body, token_ids), False
        return sse(chunk)

    while isinstance(item, str):
        ids = getattr(item, "token_ids", [])
        lp = logprobs_body(call, ids, getattr(item, "logprobs", None))
        chunks = []
        if deltas is not None:
            chunks = [delta_chunk(delta, lp if i == 0 else None, ids if i == 0 else [])
                      for i, delta in enumerate(deltas.push(item))]
            if (lp is not None or (call.token_ids and ids)) and not chunks:
                chunks = [delta_chunk({}, lp, ids)]  # tokens that made no text yet
        elif item or first or lp is not None or (call.token_ids and ids):
            if first and call.echo is not None:
                item = call.echo + item
            body = choice(chat, item, None, True, first)
            if lp is not None:
                body["logprobs"] = lp
            chunks, first = [sse(chunk_of(body, ids))], False
        for chunk in chunks:
            yield chunk
        item = await generation.items.get()
    error = refusal(item)
    if error is not None:
        yield sse(error.payload())
    else:
        finish = item.finish_reason
        if deltas is not None:
            for delta in deltas.end():
                yield delta_chunk(delta)
            if deltas.called and finish == "stop":
                finish = "tool_calls"
            if first:
                yield delta_chunk({})
        chunk = chunk_of(choice(chat, call.echo if first else None, finish, True, first),
                         [] if first else None)
        if call.include_usage and index is None:
            chunk["usage"] = usage(item)
        if ended is not None:
            ended.append(item)
        yield sse(chunk)
    if index is None:
        yield "data: [DONE]\n\n"

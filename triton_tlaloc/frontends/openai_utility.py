"""`tlaloc openai`'s routes beside the generations, in vLLM's shapes:

    GET  /health        200 when every served model's generate model is ready, else 503
    POST /tokenize      {"model", "prompt" | "messages", ...}: the ids a generation would get
    POST /detokenize    {"model", "tokens"}: their text

/tokenize renders messages with the chat template as /v1/chat/completions does (tools and
chat_template_kwargs included), so a client can count a chat's prompt before it sends it.
Both check sizes before they work (the prompt's characters, the tokens' count) and run off the
event loop. /health asks tritonserver (gRPC) whether each generate model is ready: a model
whose process died is not, so a load balancer stops sending to it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from .http_doors import APIError, parse_body, shown, typed
from .openai_requests import chat_call, served_model, token_id_problem, too_long

router = APIRouter()


def grpc_ready(url: str, generate_model: str) -> bool:
    """Whether tritonserver at `url` (gRPC) has `generate_model` ready."""
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(url) as client:
            return bool(client.is_model_ready(generate_model))
    except Exception:  # the server unreachable is not ready either
        return False


@router.get("/health")
async def health(request: Request):
    state = request.app.state
    ready = await run_in_threadpool(lambda: {
        name: state.ready(state.url, m.generate_model) for name, m in state.models.items()})
    if all(ready.values()):
        return Response(status_code=200)
    down = ", ".join(name for name, ok in ready.items() if not ok)
    return JSONResponse({"error": {"message": f"not ready: {down}", "type": "unavailable",
                                   "code": 503}}, status_code=503)


def tokenized(models: dict, body: dict, max_prompt_chars: int) -> dict:
    """POST /tokenize: a prompt (add_special_tokens, default true) or chat messages (with the
    generation prompt, as a chat completion renders them)."""
    if "messages" in body:
        call = chat_call(models, {**body, "stream": False}, max_prompt_chars)
        model, ids = call.model, call.prompt_ids
    else:
        model = served_model(models, body)
        prompt = typed(body, "prompt", (str,), "a string")
        if prompt is None:
            raise APIError(400, "prompt or messages: one is required")
        if len(prompt) > max_prompt_chars:
            raise too_long("prompt", len(prompt), max_prompt_chars)
        special = typed(body, "add_special_tokens", (bool,), "true or false")
        ids = model.tokenizer.encode(prompt, add_special_tokens=special is not False)
    return {"count": len(ids), "max_model_len": model.max_context, "tokens": ids,
            "token_strs": None}


def detokenized(models: dict, body: dict, max_prompt_chars: int) -> dict:
    """POST /detokenize: the text of token ids."""
    model = served_model(models, body)
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_prompt_chars:
        raise too_long("tokens", len(tokens), max_prompt_chars, "token ids")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise APIError(400, f"tokens: a list of token ids, not {shown(tokens)}")
    # Checked here: the tokenizer decodes an id it does not know as nothing, silently.
    if (problem := token_id_problem(tokens, model.vocab)) is not None:
        raise APIError(400, f"tokens: {problem}")
    try:
        return {"prompt": model.tokenizer.decode(tokens)}
    except Exception as e:  # an id past the vocabulary
        raise APIError(400, f"tokens: {e}")


async def _answer(request: Request, handle) -> dict:
    state = request.app.state
    raw = await request.body()
    return await run_in_threadpool(
        lambda: handle(state.models, parse_body(raw), state.options.max_prompt_chars))


@router.post("/tokenize")
async def tokenize(request: Request):
    return await _answer(request, tokenized)


@router.post("/detokenize")
async def detokenize(request: Request):
    return await _answer(request, detokenized)


__all__ = ["detokenized", "grpc_ready", "router", "tokenized"]

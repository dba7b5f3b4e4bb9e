"""`tlaloc openai`'s routes that load and unload LoRA adapters while serving, in vLLM's shapes:

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"[, "model"]}
    POST /v1/unload_lora_adapter   {"lora_name"[, "model"]}

Closed (404) unless the server was given an admin key (`--admin-key`), and then only for a
request that carries it in the `x-tlaloc-admin-key` header (403 otherwise); the API key, when
there is one, is asked for as on every route. The sequence model obeys the command only with
its server's admin key, which this server sends as its own: `tlaloc serve` and `tlaloc openai`
are given the same key (TLALOC_ADMIN_KEY). The path is the sequence model's to check: it
loads only from under its `lora_updates_root` (a relative path is taken from there). A load or
unload is one request to the base model's sequence model (the request parameter lora_admin);
what it refuses comes back as a 400 naming why, and nothing changes. After a load the adapter
is a model of its own name here, as the adapters the sequence model was started with are.
"""

from __future__ import annotations

import hmac
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from .http_doors import APIError, parse_body, typed
from .openai_responses import failure_error

router = APIRouter()
ADMIN_HEADER = "x-tlaloc-admin-key"


def send_admin(url: str, model: str, command: dict, key: str) -> None:
    """The command to `model`'s sequence model at `url` (gRPC) with the admin key `key`, which
    the sequence model checks against its server's: InferError when refused."""
    from .client import TlalocClient, new_sequence_id

    with TlalocClient(url, model, "grpc") as c:
        c.request(new_sequence_id(), [], start=True, end=True, outputs=("KV_PAGES",),
                  admin=command, admin_key=key)


def _checked(request: Request) -> None:
    key = request.app.state.options.admin_key
    if not key:
        raise APIError(404, "loading adapters while serving is off here (tlaloc openai "
                            "--admin-key)")
    given = request.headers.get(ADMIN_HEADER, "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(403, f"the admin key ({ADMIN_HEADER}) is missing or wrong")


def _base(request: Request, body: dict):
    """The base model the adapter is of: `model`, or the one base model served."""
    models = request.app.state.models
    bases = sorted(n for n, m in models.items() if m.lora is None)
    name = typed(body, "model", (str,), "a model's name")
    if name is None and len(bases) == 1:
        name = bases[0]
    if name not in bases:
        raise APIError(400, f"model {name!r}: the base model the adapter is of, one of "
                            f"{', '.join(bases)}")
    return models[name]


async def _send(request: Request, base, command: dict) -> None:
    from .client import InferError

    send = request.app.state.send_admin
    try:
        await run_in_threadpool(send, request.app.state.url, base.name, command,
                                request.app.state.options.admin_key)
    except InferError as e:  # its refusal a 400, a full model a 503, its failure a 500
        raise failure_error(str(e), e.status) from None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    _checked(request)
    body = parse_body(await request.body())
    name = typed(body, "lora_name", (str,), "an adapter's name")
    path = typed(body, "lora_path", (str,), "the adapter's directory")
    if not name or not path:
        raise APIError(400, "lora_name and lora_path: both are needed")
    models = request.app.state.models
    if name in models:
        raise APIError(400, f"lora_name {name!r}: a model of that name is served already")
    base = _base(request, body)
    await _send(request, base, {"load": {"name": name, "path": path}})
    models[name] = base.adapter(name)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    _checked(request)
    body = parse_body(await request.body())
    name = typed(body, "lora_name", (str,), "an adapter's name")
    models = request.app.state.models
    if name not in models or models[name].lora is None:
        raise APIError(400, f"lora_name {name!r}: no adapter of that name is served")
    await _send(request, models[models[name].parent], {"unload": name})
    del models[name]
    return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                    media_type="text/plain")


__all__ = ["ADMIN_HEADER", "router", "send_admin"]

"""The sequence model's LoRA adapters: the registry of the adapters named by the lora_adapters
parameter (read and checked when the model loads: one that does not fit fails the load, by
name), and a request's `lora` parameter."""

from __future__ import annotations

import hmac
import json
import logging

from ..lora.peft_adapter import AdapterError, read_peft_adapter
from .server import ADMIN_KEY_ENV
from ..lora.registry import AdapterRegistry, checked_admin_command, parse_adapters

log = logging.getLogger("triton_tlaloc.adapters")


def adapter_registry(runtime, params: dict) -> AdapterRegistry | None:
    """The registry over the runtime's adapter pools with the lora_adapters parameter's
    adapters registered; None when the artifact takes no adapters."""
    pools = getattr(runtime, "adapters", None)
    named = parse_adapters(params.get("lora_adapters", ""))
    if pools is None:
        if named:
            raise AdapterError(f"lora_adapters names {', '.join(named)}, and the artifact takes "
                               f"no adapters (export it with --max-lora-rank)")
        return None
    layout = runtime.artifact.lora
    registry = AdapterRegistry(layout.slots - 1, lambda path: read_peft_adapter(path, layout),
                               pools.write, int(params.get("lora_host_bytes") or 0),
                               updates_root=params.get("lora_updates_root") or None)
    for name, directory in named.items():
        adapter = registry.register(name, directory)
        log.info("adapter %s: %s, rank %d, %.1f MiB", name, directory, adapter.rank,
                 adapter.nbytes / 2**20)
    if named or registry.updates_root is not None:
        pools.warm()  # the slot write compiled before the model reports ready
    return registry


def lora_admin_parameter(parameters: dict, admin_key: str | None) -> dict | None:
    """A request's lora_admin: an adapter load or unload, a JSON object given as one or as its
    text, its shape checked here (so that nothing malformed reaches the batching thread, where
    lora/registry.AdapterRegistry.update acts on it). Whoever reaches the inference port may
    send it, so it is obeyed only with the server's admin key (`admin_key`) in the parameter
    lora_admin_key: refused by name when the key is missing or wrong, or the server has none.
    AdapterError naming the problem."""
    command = parameters.get("lora_admin")
    if command is None:
        return None
    if not admin_key:
        raise AdapterError(f"lora_admin: adapter updates need the server's admin key, and this "
                           f"server has none (tlaloc serve --admin-key, or {ADMIN_KEY_ENV} in "
                           f"tritonserver's environment)")
    given = parameters.get("lora_admin_key")
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), admin_key.encode()):
        log.warning("lora_admin refused: the admin key is missing or wrong")
        raise AdapterError("lora_admin: the admin key (parameter lora_admin_key) is missing or "
                           "wrong")
    if isinstance(command, str):
        try:
            command = json.loads(command)
        except ValueError:
            raise AdapterError("lora_admin: expected a JSON object, as text or as one") from None
    checked_admin_command(command)
    return command


def lora_parameter(parameters: dict) -> str | None:
    """A request's lora: the adapter's name, a string (None: none)."""
    name = parameters.get("lora")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"parameter lora {name!r}: expected an adapter's name (a string)")
    return name or None


__all__ = ["adapter_registry", "lora_admin_parameter", "lora_parameter"]

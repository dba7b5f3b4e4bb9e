"""The sequence model's LoRA adapters: the registry of the adapters named by the lora_adapters
parameter (read and checked when the model loads: one that does not fit fails the load, by
name), and a request's `lora` parameter."""

from __future__ import annotations

import json
import logging

from ..lora.peft_adapter import AdapterError, read_peft_adapter
from ..lora.registry import AdapterRegistry, parse_adapters

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


def lora_admin_parameter(parameters: dict) -> dict | None:
    """A request's lora_admin: an adapter load or unload (lora/registry.AdapterRegistry.update
    checks it), a JSON object, given as one or as its text."""
    command = parameters.get("lora_admin")
    if isinstance(command, str):
        command = json.loads(command)
    if command is not None and not isinstance(command, dict):
        raise ValueError("parameter lora_admin: expected a JSON object")
    return command


def lora_parameter(parameters: dict) -> str | None:
    """A request's lora: the adapter's name, a string (None: none)."""
    name = parameters.get("lora")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"parameter lora {name!r}: expected an adapter's name (a string)")
    return name or None


__all__ = ["adapter_registry", "lora_admin_parameter", "lora_parameter"]

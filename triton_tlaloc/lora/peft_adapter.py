"""A PEFT LoRA adapter as PEFT saves it (adapter_config.json, adapter_model.safetensors) read
into an artifact's adapter pools (layout.LoraLayout): each adapted module's A and B checked
against the base model's shapes and the pools' rank, its scaling folded into B, and the
modules a part fuses placed as the part's rows and columns. What this cannot serve (DoRA,
biases, embedding or head adapters, a rank over the pools') is refused by name, before
anything is loaded."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .layout import LoraLayout

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# an adapted module's tensor: ...layers.<i>.<module path>.lora_A.weight (or lora_B)
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem and the adapter."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter in an artifact's pool layout: each pool's slot, by pool name ([layers,
    width, in] for A, [layers, out, width] for B, f32), its largest rank and its identity (a
    hash of its files)."""

    path: str
    arrays: dict[str, np.ndarray]
    rank: int
    content_hash: str

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def read_peft_adapter(path: str | Path, layout: LoraLayout) -> LoraAdapter:
    """The adapter in `path` in `layout`'s pools. AdapterError names what does not fit."""
    from safetensors.numpy import load

    path = Path(path)
    where = str(path)
    config_file, weights_file = path / CONFIG, path / WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"adapter {where}: no {f.name} (a PEFT LoRA adapter's files: "
                               f"{CONFIG} and {WEIGHTS})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {where}: {CONFIG} is not JSON: {e}") from None
    _check_config(where, config)
    raw_config, raw_weights = config_file.read_bytes(), weights_file.read_bytes()
    try:
        tensors = load(raw_weights)  # (the bytes already read for the hash)
    except Exception as e:  # safetensors' own errors name no common class
        raise AdapterError(f"adapter {where}: {WEIGHTS} cannot be read: {e}") from None
    pairs = _module_pairs(where, tensors, layout)
    arrays = {name: np.zeros((shape[0], *shape[2:]), np.float32)
              for name, shape in layout.pool_shapes().items()}
    by_module = {m: (p, j) for p in layout.parts for j, m in enumerate(p.modules)}
    rank = 0
    for (layer, module), (a, b) in sorted(pairs.items()):
        part, j = by_module[module]
        full = f"model.layers.{layer}.{module}"
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r or r < 1:
            raise AdapterError(f"adapter {where}: {full}: lora_A {list(a.shape)} and lora_B "
                               f"{list(b.shape)} are not a rank-r pair (r >= 1)")
        for which, t in (("lora_A", a), ("lora_B", b)):
            # NaN or infinity would reach the logits of every row that uses the adapter, and
            # through their KV the sequences that continue or reuse it
            if not np.isfinite(t).all():
                raise AdapterError(f"adapter {where}: {full}.{which} holds "
                                   f"{int((~np.isfinite(t)).sum())} values that are NaN or "
                                   f"infinite")
        if r > layout.max_rank:
            raise AdapterError(f"adapter {where}: {full} has rank {r}, over the artifact's "
                               f"largest {layout.max_rank} (export with --max-lora-rank {r} "
                               f"or more)")
        if a.shape[1] != part.n_in or b.shape[0] != part.outs[j]:
            raise AdapterError(f"adapter {where}: {full} adapts a [{b.shape[0]}, {a.shape[1]}] "
                               f"weight where the base model's is [{part.outs[j]}, "
                               f"{part.n_in}]: it was trained for another model")
        if layer >= layout.layers:
            raise AdapterError(f"adapter {where}: {full}: the base model has "
                               f"{layout.layers} layers")
        scale = _scaling(where, config, full, r)
        col = j * layout.max_rank
        row = sum(part.outs[:j])
        arrays[layout.pool_name(part.part, "a")][layer, col:col + r] = a
        arrays[layout.pool_name(part.part, "b")][layer, row:row + b.shape[0], :r] = (
            b.astype(np.float32) * np.float32(scale))
        rank = max(rank, r)
    digest = hashlib.sha256(raw_config + hashlib.sha256(raw_weights).digest()).hexdigest()
    return LoraAdapter(where, arrays, rank, digest)


def _check_config(where: str, config: dict) -> None:
    """Refuses, by name, the adapters whose updates are not B A x on the linears."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter {where}: peft_type {kind!r}: only LoRA adapters are served")
    refused = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out weights",
               "lora_bias": "a LoRA bias (lora_bias)",
               "modules_to_save": "modules trained whole (modules_to_save)",
               "trainable_token_indices": "trained embedding rows (trainable_token_indices)",
               "target_parameters": "adapted parameters (target_parameters)"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"adapter {where}: {what} is not served (a LoRA adapter of "
                               f"the attention and MLP linears is)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {where}: bias {config['bias']!r} is not served (a LoRA "
                           f"adapter with bias 'none' is)")


def _module_pairs(where: str, tensors: dict, layout: LoraLayout) -> dict:
    """(layer, module) -> (A, B) of every adapted module; a tensor of anything else refused."""
    modules = {m for p in layout.parts for m in p.modules}
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m[2] not in modules:
            raise AdapterError(f"adapter {where}: tensor {key} adapts what this backend does "
                               f"not (it adapts {', '.join(sorted(modules))}: q/k/v/o and "
                               f"gate/up/down of the decoder layers)")
        found.setdefault((int(m[1]), m[2]), {})[m[3]] = np.asarray(t, np.float32)
    pairs = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {where}: model.layers.{layer}.{module} has lora_"
                               f"{''.join(ab)} without its pair")
        pairs[layer, module] = (ab["A"], ab["B"])
    if not pairs:
        raise AdapterError(f"adapter {where}: {WEIGHTS} adapts no module")
    return pairs


def _scaling(where: str, config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of a module's update: lora_alpha / r, or lora_alpha / sqrt(r) with
    rsLoRA; rank_pattern and alpha_pattern override r and lora_alpha by module name (a key
    matches the name or its end after a dot)."""
    r = _pattern(config.get("rank_pattern"), module, config.get("r", rank))
    alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", r))
    if r != rank:
        raise AdapterError(f"adapter {where}: {module}: its config says rank {r}, its tensors "
                           f"{rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {where}: {module}: lora_alpha {alpha!r}: expected a finite "
                           f"number")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns: dict | None, module: str, default):
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


__all__ = ["AdapterError", "LoraAdapter", "read_peft_adapter"]

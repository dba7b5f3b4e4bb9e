"""Packed weights at export: which linear slots an artifact stores packed (gguf_packed's
layout), in which type, and each such slot's arrays.

- `--weight-quant gguf`, `awq`, `gptq`: a GGUF file's quantized tensors kept in their own types,
  an AWQ or GPTQ checkpoint's 4-bit linears as they are (hf_packed); tensors a
  slot fuses, or a loop's layers, of different types share one layout that holds them all
  (gguf_packed.mixed_type). A type not kept packed, or quantized tensors fused or looped with
  float ones, are refused by name before any weight is written.
- `--weight-quant int4`: every layer's linears (the head too with --quant-head) quantized from
  the checkpoint's values (quant.quantize_int4).

A mixture's stacked experts are packed expert by expert (each its own rows, as a linear's),
their arrays stacked: [experts, ...] each.
"""

from __future__ import annotations

from .checkpoint import Checkpoint, HfCheckpoint, expert_sources, linear_sources
from .gguf_checkpoint import GgufCheckpoint
from .config import DecoderConfig
from .decoder import WeightSlot, slot_layer, slot_part, weight_slots
from .gguf_packed import (BLOCKS, PackedWeight, PackError, int4_type, layout_of, mixed_type,
                          stack_rows)
from .options import ExportError, ExportOptions
from .quant import quantize_int4

WAY_OUT = "--weight-quant int8 or f32 reads any type"
OWN = {"gguf": "a GGUF file", "awq": "an AWQ checkpoint", "gptq": "a GPTQ checkpoint"}


def slot_quants(ckpt: Checkpoint, cfg: DecoderConfig, opts: ExportOptions,
                layer_loop: bool) -> dict[str, str]:
    """Each packed linear slot's type, by the name decoder.weight_slots looks up ("embed" for
    the table, "l0.<part>" for every layer of a loop)."""
    if opts.weight_quant == "int4":
        qtype = int4_type(opts.quant_group, opts.quant_zero_point)
        # the head with --quant-head: a tied model's table (its f32 slot is "embed_t"), else
        # lm_head (the untied table stays)
        head = ("embed_t" if cfg.tie_word_embeddings else "lm_head") if opts.quant_head else None
        quants = {"embed" if s.name == "embed_t" else s.name: qtype for s in weight_slots(cfg)
                  if _sources(cfg, s) is not None and (_in_layer(s.name) or s.name == head)}
        return _looped(ckpt, cfg, quants) if layer_loop else quants
    return _own_quants(ckpt, cfg, opts.weight_quant, layer_loop)


def _own_quants(ckpt: Checkpoint, cfg: DecoderConfig, method: str,
                layer_loop: bool) -> dict[str, str]:
    """--weight-quant gguf, awq or gptq: each linear slot in the type its tensors are stored
    in, when the checkpoint is of that kind."""
    kind = ckpt.hf_quant.method if isinstance(ckpt, HfCheckpoint) and ckpt.hf_quant else (
        "gguf" if isinstance(ckpt, GgufCheckpoint) else None)
    if kind != method:
        raise ExportError(f"{ckpt.path}: --weight-quant {method} keeps the blocks of "
                          f"{OWN[method]}, and this checkpoint is "
                          f"{'not one' if kind is None else OWN[kind]} ({WAY_OUT})")
    quants: dict[str, str] = {}
    for slot in weight_slots(cfg):
        sources = _sources(cfg, slot)
        if sources is None:
            continue
        types = [ckpt.packed_type(n) for n in sources]
        if all(t is None for t in types):
            continue
        if None in types:
            raise ExportError(f"{ckpt.path}: weight {slot.name} fuses quantized and float "
                              f"tensors ({_named_types(ckpt, sources)}; {WAY_OUT})")
        for name, qtype in zip(sources, types):
            if layout_of(qtype) is None:
                raise ExportError(f"{ckpt.path}: tensor {ckpt.file_name(name)} is {qtype}, a "
                                  f"GGUF type not kept packed (kept: {', '.join(BLOCKS)}; "
                                  f"{WAY_OUT})")
        quants["embed" if slot.name == "embed_t" else slot.name] = mixed_type(types)
    return _looped(ckpt, cfg, quants) if layer_loop else quants


def _looped(ckpt: Checkpoint, cfg: DecoderConfig, quants: dict[str, str]) -> dict[str, str]:
    """The layers' types as the layer loop's: one type per part for every layer."""
    looped = {k: v for k, v in quants.items() if not _in_layer(k)}
    parts = {k.split(".", 1)[1] for k in quants if k not in looped}
    for part in sorted(parts):
        by_layer = [quants.get(f"l{i}.{part}") for i in range(cfg.num_layers)]
        if None in by_layer and len(set(by_layer)) > 1:
            seen = ", ".join(f"layer {i}: {t or 'float'}" for i, t in enumerate(by_layer)
                             if t != by_layer[0] or i == 0)
            raise ExportError(f"{ckpt.path}: the layer loop needs every layer's {part} "
                              f"packed or none, and the file's differ ({seen}); "
                              f"--no-layer-loop keeps each layer's own")
        # layers of different types (a Q4_K_M file's ffn_down) share one layout
        looped[f"l0.{part}"] = mixed_type(by_layer)
    return looped


def _sources(cfg: DecoderConfig, slot: WeightSlot) -> list[str] | None:
    """The checkpoint tensors a slot that can be packed holds: a linear's (fused along its
    rows), or every expert's of a stacked experts slot; None for any other slot."""
    if slot.kind != "experts":
        return linear_sources(slot.name)
    return [n for names in _expert_names(cfg, slot.name) for n in names]


def _expert_names(cfg: DecoderConfig, slot_name: str) -> list[tuple[str, ...]]:
    """Each expert's tensors, fused along their rows, of a stacked experts slot."""
    return expert_sources(cfg.family, slot_layer(slot_name), slot_part(slot_name),
                          cfg.moe.num_experts)


def _in_layer(slot_name: str) -> bool:
    """Whether a slot name is a layer's ("l3.down"; not "lm_head")."""
    return slot_part(slot_name) != slot_name


def _named_types(ckpt: Checkpoint, sources) -> str:
    return ", ".join(f"{ckpt.file_name(n)} {ckpt.packed_type(n) or 'float'}" for n in sources)


def packed_experts(ckpt: Checkpoint, cfg: DecoderConfig, slot_name: str, quant: str,
                   values) -> list[PackedWeight]:
    """A stacked experts slot's weight, expert by expert: an int4 type quantized from
    `values()` (the slot's [experts, out, in] f32), a GGUF type each expert's blocks out of
    the file's stacked tensors, fused along their rows."""
    try:
        if quant.startswith("INT4"):
            layout = layout_of(quant)
            return [quantize_int4(v, layout.group, layout.offset) for v in values()]
        return [stack_rows([ckpt.packed(n) for n in names], slot_name, quant)
                for names in _expert_names(cfg, slot_name)]
    except PackError as e:
        raise ExportError(f"{ckpt.path}: weight {slot_name}: {e}") from None


def packed_slot(ckpt: Checkpoint, slot_name: str, quant: str, values) -> PackedWeight:
    """A packed slot's weight: an int4 type quantized from `values()` (the slot's [out, in]
    f32), a GGUF type the file's own tensors, fused along their rows."""
    try:
        if quant.startswith("INT4"):
            layout = layout_of(quant)
            return quantize_int4(values(), layout.group, layout.offset)
        return stack_rows([ckpt.packed(n) for n in linear_sources(slot_name)], slot_name, quant)
    except PackError as e:
        raise ExportError(f"{ckpt.path}: weight {slot_name}: {e}") from None

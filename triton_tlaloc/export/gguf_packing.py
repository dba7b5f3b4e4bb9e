"""`--weight-quant gguf`: a GGUF file's quantized tensors kept in their own types. Which type
each linear slot takes (the tensors it fuses must agree, and with the layer loop every layer),
and a slot's packed arrays read from the file (gguf_packed's layout). A type not kept packed,
or tensors that do not agree, are refused by name before any weight is written."""

from __future__ import annotations

from .checkpoint import Checkpoint, GgufCheckpoint, linear_sources
from .config import DecoderConfig
from .decoder import weight_slots
from .gguf_packed import LAYOUTS, PackedWeight, PackError, stack_rows
from .options import ExportError

FLOAT_TYPES = ("F32", "F16", "BF16")  # read as values: the slot keeps the weight dtype
WAY_OUT = "--weight-quant int8 or f32 reads any type"


def slot_quants(ckpt: Checkpoint, cfg: DecoderConfig, layer_loop: bool) -> dict[str, str]:
    """Each quantized linear slot's GGUF type, by the name decoder.weight_slots looks up
    ("embed" for the table, "l0.<part>" for every layer of a loop)."""
    if not isinstance(ckpt, GgufCheckpoint):
        raise ExportError(f"{ckpt.path}: --weight-quant gguf keeps a GGUF file's own blocks, "
                          f"and this checkpoint is not a GGUF file ({WAY_OUT})")
    quants: dict[str, str] = {}
    for slot in weight_slots(cfg):
        sources = linear_sources(slot.name)
        if sources is None:
            continue
        types = {ckpt.tensor_type(n) for n in sources}
        if types <= set(FLOAT_TYPES):
            continue
        for name in sources:
            qtype = ckpt.tensor_type(name)
            if qtype not in LAYOUTS:
                raise ExportError(f"{ckpt.path}: tensor {ckpt.file_name(name)} is {qtype}, a "
                                  f"GGUF type not kept packed (kept: {', '.join(LAYOUTS)}; "
                                  f"{WAY_OUT})")
        if len(types) > 1:
            raise ExportError(f"{ckpt.path}: weight {slot.name} fuses tensors of different "
                              f"GGUF types ({_named_types(ckpt, sources)}; {WAY_OUT})")
        quants["embed" if slot.name == "embed_t" else slot.name] = types.pop()
    return _looped(ckpt, cfg, quants) if layer_loop else quants


def _looped(ckpt: Checkpoint, cfg: DecoderConfig, quants: dict[str, str]) -> dict[str, str]:
    """The layers' types as the layer loop's: one type per part for every layer."""
    looped = {k: v for k, v in quants.items() if not k[:1] == "l" or not k[1:2].isdigit()}
    parts = {k.split(".", 1)[1] for k in quants if k not in looped}
    for part in sorted(parts):
        by_layer = [quants.get(f"l{i}.{part}") for i in range(cfg.num_layers)]
        if len(set(by_layer)) > 1:
            seen = ", ".join(f"layer {i}: {t or 'float'}" for i, t in enumerate(by_layer)
                             if t != by_layer[0] or i == 0)
            raise ExportError(f"{ckpt.path}: the layer loop needs one type for every layer's "
                              f"{part}, and the file's differ ({seen}); --no-layer-loop keeps "
                              f"each layer's own")
        looped[f"l0.{part}"] = by_layer[0]
    return looped


def _named_types(ckpt: Checkpoint, sources) -> str:
    return ", ".join(f"{ckpt.file_name(n)} {ckpt.tensor_type(n)}" for n in sources)


def packed_slot(ckpt: GgufCheckpoint, slot_name: str) -> PackedWeight:
    """A slot's tensors kept packed, fused along their rows."""
    sources = linear_sources(slot_name)
    try:
        return stack_rows([ckpt.packed(n) for n in sources], slot_name)
    except PackError as e:
        raise ExportError(f"{ckpt.path}: {e}") from None

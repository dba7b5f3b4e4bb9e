"""The exporter's tensor-parallel plan: which weights and pools split over N devices, Megatron
style (docs/design.md#tensor-parallelism).

- Column-parallel (split along their outputs): q|k|v, gate|up, a linear layer's fused input
  projection, with their quantization scales; each device computes its heads and its part of
  the MLP's intermediate.
- Row-parallel (split along their inputs): o_proj, down, a linear layer's out_proj. Each
  device's product is a partial sum; XLA's partitioner adds the all-reduce.
- The KV pools split by KV head, a linear layer's conv states by channel and its recurrent
  states by value head; the conv kernel, A_log and dt_bias go with their channels and heads.
- The embedding and the head split by vocabulary (when it divides; `split_vocab`): each
  device gathers its rows of the table (the partitioner sums the rows over the devices) and
  computes its columns of the logits (gathered).
- A mixture's experts by expert (expert parallelism): E / N whole experts a device, each
  device computing with its own, their outputs summed in one all-reduce; the router is
  replicated (export/moe.py). Replicated: every norm, and the embedding and
  the head when not split.

A model with fewer KV heads than devices holds each KV head on N / kv_heads devices (as vLLM
does): the program is the model with each KV head repeated (`logical_config`), its k and v
weights cut from the file with copies; a linear layer's key heads likewise. Heads that do not divide over the devices are refused
by name.
"""

from __future__ import annotations

import dataclasses

from .config import DecoderConfig
from .decoder import STACKED, slot_part
from .gguf_packed import is_packed, layout_of
from ..artifact.sharding import Segment, Split, TensorParallel, single_split


class TensorParallelError(ValueError):
    """A model that cannot be split over the devices asked for; names the numbers."""


def head_copies(heads: int, devices: int, what: str, model: str) -> int:
    """How many devices hold each of `heads` heads: 1 when they divide over the devices, else
    devices / heads when that divides; refused by name otherwise."""
    if heads % devices == 0:
        return 1
    if devices % heads == 0:
        return devices // heads
    raise TensorParallelError(f"{model}: {heads} {what} neither divide over {devices} devices "
                              f"nor divide {devices} (each device holds whole heads, or each "
                              f"head is held by several devices)")


def head_copies_of(cfg: DecoderConfig, devices: int) -> tuple[int, int]:
    """How many devices hold each KV head and each linear layer's key head (1 when there are
    none); refuses a model whose heads or MLP do not divide."""
    name = cfg.model_name
    if cfg.num_heads % devices:
        raise TensorParallelError(
            f"{name}: {cfg.num_heads} attention heads do not divide over {devices} devices "
            f"(tensor parallelism gives each device whole heads)")
    if cfg.intermediate_size % devices:
        raise TensorParallelError(f"{name}: the MLP's {cfg.intermediate_size} channels do not "
                                  f"divide over {devices} devices")
    if cfg.moe is not None and cfg.moe.num_experts % devices:
        raise TensorParallelError(f"{name}: {cfg.moe.num_experts} experts do not divide over "
                                  f"{devices} devices (expert parallelism gives each device "
                                  f"whole experts)")
    kv = head_copies(cfg.num_kv_heads, devices, "KV heads", name)
    la = cfg.linear
    if la is None:
        return kv, 1
    if la.num_value_heads % devices:
        raise TensorParallelError(f"{name}: the linear layers' {la.num_value_heads} value "
                                  f"heads do not divide over {devices} devices")
    return kv, head_copies(la.num_key_heads, devices, "linear-layer key heads", name)


def logical_config(cfg: DecoderConfig, devices: int) -> DecoderConfig:
    """The model the programs compute: `cfg` with each KV head (and each linear layer's key
    head) repeated for the devices that share it; itself when every device holds whole
    heads."""
    kv, keys = head_copies_of(cfg, devices)
    la = cfg.linear
    if la is not None:
        la = dataclasses.replace(la, num_key_heads=la.num_key_heads * keys)
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv, linear=la)


def _packed_split(model: str, s, lead: int, column: dict, row: dict,
                  devices: int) -> Split | None:
    """The split of one array of a packed weight (gguf_packed: code planes [rows / fields,
    cols], scales and offsets [rows, cols / group]): along its rows, each segment's rows per
    field, every device's piece of a segment whole bands (the writer bands each piece on its
    own); along its inputs, on group boundaries. A vocabulary-split table that does not cut
    into whole bands is copied whole, as one that does not divide."""
    layout = layout_of(s.quant)
    base = slot_part(s.name)
    for sfx in (".high", ".scale", ".offset"):
        base = base[:-len(sfx)] if base.endswith(sfx) else base
    if base in column:
        segments = column[base]
        rows = sum(seg.width for seg in segments)
        fields = rows // s.shape[lead]  # 1 for scales, offsets and 8-bit codes
        for seg in segments:
            piece = seg.width * seg.copies // devices
            if piece % layout.bands:
                if base in ("embed", "lm_head"):
                    return None
                raise TensorParallelError(
                    f"{model}: {base}'s parts of {piece} rows a device do not cut into the "
                    f"{layout.bands} row bands of its packed type {s.quant}")
        return Split(lead, tuple(Segment(seg.width // fields, seg.copies) for seg in segments))
    if base in row:
        width = s.shape[lead + 1]  # inputs, or groups of them
        if width % devices:
            raise TensorParallelError(
                f"{model}: {base}'s {row[base]} inputs, in groups of {layout.group} "
                f"({s.quant}), do not split over {devices} devices on group boundaries")
        return single_split(lead + 1, width)
    return None


def packed_row_split(tp: TensorParallel | None, slot) -> Split | None:
    """A packed weight's split along its rows (its scales', in rows: each device's piece of
    each segment is banded on its own); None when it is not packed or not split so."""
    split = tp.weights.get(f"{slot.name}.scale") if tp is not None else None
    lead = 1 if slot.name.startswith(STACKED) else 0
    if not is_packed(slot.quant) or slot.kind != "linear" or split is None or split.axis != lead:
        return None
    return split


def plan(cfg: DecoderConfig, devices: int, slots, pools, state_pools,
         split_vocab: bool = False) -> TensorParallel:
    """The splits of an artifact's weight slots (as the files hold them, decoder.WeightSlot),
    its KV pools and its state pools (as the programs hold them)."""
    copies, key_copies = head_copies_of(cfg, devices)
    d, kv = cfg.head_size, cfg.num_kv_heads
    q_width = cfg.num_heads * d * (2 if cfg.attn_output_gate else 1)
    la = cfg.linear
    column = {  # segments along the output axis
        "qkv": (Segment(q_width), Segment(kv * d, copies), Segment(kv * d, copies)),
        "gate_up": (Segment(cfg.intermediate_size),) * 2,
    }
    row = {"o": cfg.num_heads * d, "down": cfg.intermediate_size}  # the input axis's width
    shared = cfg.moe.shared_intermediate_size if cfg.moe is not None else 0
    if shared:  # a mixture's shared expert splits as a dense MLP does
        column["shared_gate_up"] = (Segment(shared),) * 2
        row["shared_down"] = shared
    params = {}
    if la is not None:
        qk, v = la.num_key_heads * la.key_head_dim, la.value_dim
        channels = (Segment(qk, key_copies), Segment(qk, key_copies), Segment(v))
        column["lin_in"] = (*channels, Segment(v), Segment(la.num_value_heads),
                            Segment(la.num_value_heads))
        row["lin_out"] = v
        params = {"conv": channels, "A_log": (Segment(la.num_value_heads),),
                  "dt_bias": (Segment(la.num_value_heads),)}
    weights = {}
    vocab = cfg.vocab_size
    by_vocab = split_vocab and vocab % devices == 0
    if by_vocab:  # the embedding and the head by vocabulary
        for s in slots:  # [vocab, hidden] tables and scales; [hidden, vocab] ones on axis 1
            if is_packed(s.quant):  # (below, with the other packed weights)
                continue
            if s.name in ("embed", "embed.scale", "lm_head.scale") or (
                    s.name == "lm_head" and (s.out_first or s.quant)):
                weights[s.name] = single_split(0, vocab)
            elif s.name in ("embed_t", "lm_head"):
                weights[s.name] = single_split(1, vocab)
    for s in slots:
        stacked = s.name.startswith("layers.")
        lead = 1 if stacked else 0  # a stacked slot's first axis is the layer
        part = s.name.split(".", 1)[-1]
        base, scale = (part[:-len(".scale")], True) if part.endswith(".scale") else (part, False)
        if part.split(".")[0] in ("experts_gate_up", "experts_down"):
            # by expert, whole experts a device (a packed one's every array too)
            weights[s.name] = single_split(lead, cfg.moe.num_experts)
            continue
        if is_packed(s.quant):
            vocab_rows = {"embed": (Segment(vocab),), "lm_head": (Segment(vocab),)}
            split = _packed_split(cfg.model_name, s, lead, {**column, **vocab_rows} if by_vocab
                                  else column, row, devices)
            if split is not None:
                weights[s.name] = split
            continue
        out_axis = lead if (s.out_first or s.quant or scale) else lead + 1
        if base in column:
            weights[s.name] = Split(out_axis, column[base])
        elif base in row and not scale:  # a row-parallel product's scales are per output
            in_axis = lead + 1 if (s.out_first or s.quant) else lead
            weights[s.name] = single_split(in_axis, row[base])
        elif base in params:
            weights[s.name] = Split(lead, params[base])
    split_pools = {}
    for p in pools:  # [pages, (layers,) block, heads, d]: by KV head
        axis = len(p.shape) - 2
        split_pools[p.name] = single_split(axis, p.shape[axis])
    for p in state_pools:
        if p.kind == "conv":  # [slots, kernel - 1, channels], the key heads' repeated
            split_pools[p.name] = Split(2, tuple(Segment(s.width * s.copies)
                                                 for s in params["conv"]))
        else:  # [slots, value heads, dk, dv]
            split_pools[p.name] = single_split(1, la.num_value_heads)
    tp = TensorParallel(devices, copies, key_copies, weights, split_pools)
    for s in slots:
        if s.name in weights:
            weights[s.name].check(s.shape, devices, f"weight {s.name}")
    for p in (*pools, *state_pools):
        split_pools[p.name].check(p.shape, devices, f"pool {p.name}")
    return tp


__all__ = ["TensorParallelError", "head_copies", "head_copies_of", "logical_config",
           "packed_row_split", "plan"]

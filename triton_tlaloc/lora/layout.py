"""The adapter pools an artifact's entries read (manifest model.lora): for each adapted part of
every layer, an A pool [layers, slots, rank x modules, in] and a B pool [layers, slots, out,
rank], f32. Slot 0 is all zeros (no adapter); a row's LORA_SLOTS index picks its adapter, and
each adapted linear adds B[slot] (A[slot] x) to its product.

A part fuses the checkpoint's modules as the artifact fuses their weights (q|k|v, gate|up):
module j's A is rows j * rank .. of the part's A, its B the rows of its outputs in the part's
B, so one product computes every module's A x and one a module each its B. An adapter of a
smaller rank fills the first columns. The scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)
is folded into B.

Over N devices (tensor parallelism) the pools split as the base weights do: a column-parallel
part's B (q|k|v, gate|up) along its outputs, each module's rows cut for the devices (k and v
repeated on the devices that share a KV head), so each device adds the update of its own
columns; a row-parallel part's A (o, down) along its inputs, each device's partial A x summed
with the product's. The other pools are copied on every device. A pool's split is in the
pool's terms ([layers, slots, ...]); an adapter's arrays are cut for each device when a slot is
written (`slot_shards`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..artifact.sharding import Segment, Split, single_split

if TYPE_CHECKING:
    import numpy as np

# The parts an adapter may target, the artifact's fused layouts: (part, its modules by their
# path inside a decoder layer)
PARTS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         ("o", ("self_attn.o_proj",)),
         ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
         ("down", ("mlp.down_proj",)))
# Column-parallel parts (their B splits along its outputs); the others are row-parallel
# (their A splits along its inputs)
COLUMN_PARTS = ("qkv", "gate_up")
# The modules whose outputs are KV heads, repeated on the devices that share one
KV_MODULES = ("self_attn.k_proj", "self_attn.v_proj")


@dataclass(frozen=True)
class LoraPart:
    """One adapted part of every layer: its modules, its input width, each module's outputs."""

    part: str
    modules: tuple[str, ...]
    n_in: int
    outs: tuple[int, ...]

    @property
    def n_out(self) -> int:
        return sum(self.outs)

    def to_json(self) -> dict:
        return {"part": self.part, "modules": list(self.modules), "in": self.n_in,
                "outs": list(self.outs)}

    @staticmethod
    def from_json(obj: dict) -> LoraPart:
        return LoraPart(obj["part"], tuple(obj["modules"]), int(obj["in"]),
                        tuple(int(o) for o in obj["outs"]))


@dataclass(frozen=True)
class LoraLayout:
    """An artifact's adapter pools: the largest rank an adapter may have, the slots (slot 0 no
    adapter), the layers and the parts; over `devices` devices (tensor parallelism), each KV
    head held by `kv_copies` of them."""

    max_rank: int
    slots: int
    layers: int
    parts: tuple[LoraPart, ...]
    devices: int = 1
    kv_copies: int = 1

    def pool_name(self, part: str, which: str) -> str:
        return f"lora.{part}.{which}"

    def pool_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each pool's shape by name, A then B of each part in order."""
        out = {}
        for p in self.parts:
            width = self.max_rank * len(p.modules)
            out[self.pool_name(p.part, "a")] = (self.layers, self.slots, width, p.n_in)
            out[self.pool_name(p.part, "b")] = (self.layers, self.slots, p.n_out, self.max_rank)
        return out

    def pool_splits(self) -> dict[str, Split]:
        """The split pools over the devices, by name (none on one device)."""
        if self.devices == 1:
            return {}
        out = {}
        for p in self.parts:
            if p.part in COLUMN_PARTS:
                out[self.pool_name(p.part, "b")] = Split(2, tuple(
                    Segment(w, self.kv_copies if m in KV_MODULES else 1)
                    for m, w in zip(p.modules, p.outs)))
            else:
                out[self.pool_name(p.part, "a")] = single_split(3, p.n_in)
        return out

    def program_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each pool's shape as the programs see it: a B pool's k and v rows repeated for the
        devices that share a KV head."""
        splits = self.pool_splits()
        return {name: splits[name].program_shape(shape) if name in splits else shape
                for name, shape in self.pool_shapes().items()}

    def shard_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each pool's shape on one device."""
        splits = self.pool_splits()
        return {name: splits[name].shard_shape(shape, self.devices) if name in splits else shape
                for name, shape in self.pool_shapes().items()}

    def slot_shards(self, name: str, array: np.ndarray) -> list[np.ndarray] | None:
        """Each device's part of a pool's slot (`array` [layers, ...], the pool's shape less
        its slot axis), or None when the pool is copied whole."""
        split = self.pool_splits().get(name)
        if split is None:
            return None
        row = Split(split.axis - 1, split.segments)  # the slot axis is not in `array`
        return [row.shard(array, d, self.devices) for d in range(self.devices)]

    def graph_pieces(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """For each part, the devices its update's outputs are split over and each module's
        outputs on one device, in the order a device holds them (1 and the modules' outputs
        when its B is whole)."""
        splits = self.pool_splits()
        out = {}
        for p in self.parts:
            split = splits.get(self.pool_name(p.part, "b"))
            out[p.part] = ((self.devices, split.device_pieces(self.devices)) if split
                           else (1, p.outs))
        return out

    @property
    def slot_bytes(self) -> int:
        """The bytes one adapter takes in the pools (f32)."""
        return sum(4 * s[0] * s[2] * s[3] for s in self.pool_shapes().values())

    def to_json(self) -> dict:
        return {"maxRank": self.max_rank, "slots": self.slots, "layers": self.layers,
                "parts": [p.to_json() for p in self.parts], "devices": self.devices,
                "kvCopies": self.kv_copies}

    @staticmethod
    def from_json(obj: dict) -> LoraLayout:
        return LoraLayout(int(obj["maxRank"]), int(obj["slots"]), int(obj["layers"]),
                          tuple(LoraPart.from_json(p) for p in obj["parts"]),
                          int(obj.get("devices", 1)), int(obj.get("kvCopies", 1)))


def lora_layout(max_rank: int, slots: int, layers: int, hidden: int, q_out: int, kv_out: int,
                o_in: int, intermediate: int, devices: int = 1,
                kv_copies: int = 1) -> LoraLayout:
    """The layout of a decoder whose every layer has attention and a dense MLP."""
    widths = {"qkv": (hidden, (q_out, kv_out, kv_out)), "o": (o_in, (hidden,)),
              "gate_up": (hidden, (intermediate, intermediate)),
              "down": (intermediate, (hidden,))}
    return LoraLayout(max_rank, slots, layers,
                      tuple(LoraPart(part, modules, *widths[part]) for part, modules in PARTS),
                      devices, kv_copies)


__all__ = ["COLUMN_PARTS", "PARTS", "LoraLayout", "LoraPart", "lora_layout"]

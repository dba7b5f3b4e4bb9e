"""The adapter pools an artifact's entries read (manifest model.lora): for each adapted part of
every layer, an A pool [layers, slots, rank x modules, in] and a B pool [layers, slots, out,
rank], f32. Slot 0 is all zeros (no adapter); a row's LORA_SLOTS index picks its adapter, and
each adapted linear adds B[slot] (A[slot] x) to its product.

A part fuses the checkpoint's modules as the artifact fuses their weights (q|k|v, gate|up):
module j's A is rows j * rank .. of the part's A, its B the rows of its outputs in the part's
B, so one product computes every module's A x and one a module each its B. An adapter of a
smaller rank fills the first columns. The scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)
is folded into B."""

from __future__ import annotations

from dataclasses import dataclass

# The parts an adapter may target, the artifact's fused layouts: (part, its modules by their
# path inside a decoder layer)
PARTS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         ("o", ("self_attn.o_proj",)),
         ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
         ("down", ("mlp.down_proj",)))


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
    adapter), the layers and the parts."""

    max_rank: int
    slots: int
    layers: int
    parts: tuple[LoraPart, ...]

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

    @property
    def slot_bytes(self) -> int:
        """The bytes one adapter takes in the pools (f32)."""
        return sum(4 * s[0] * s[2] * s[3] for s in self.pool_shapes().values())

    def to_json(self) -> dict:
        return {"maxRank": self.max_rank, "slots": self.slots, "layers": self.layers,
                "parts": [p.to_json() for p in self.parts]}

    @staticmethod
    def from_json(obj: dict) -> LoraLayout:
        return LoraLayout(int(obj["maxRank"]), int(obj["slots"]), int(obj["layers"]),
                          tuple(LoraPart.from_json(p) for p in obj["parts"]))


def lora_layout(max_rank: int, slots: int, layers: int, hidden: int, q_out: int, kv_out: int,
                o_in: int, intermediate: int) -> LoraLayout:
    """The layout of a decoder whose every layer has attention and a dense MLP."""
    widths = {"qkv": (hidden, (q_out, kv_out, kv_out)), "o": (o_in, (hidden,)),
              "gate_up": (hidden, (intermediate, intermediate)),
              "down": (intermediate, (hidden,))}
    return LoraLayout(max_rank, slots, layers,
                      tuple(LoraPart(part, modules, *widths[part]) for part, modules in PARTS))


__all__ = ["PARTS", "LoraLayout", "LoraPart", "lora_layout"]

"""Tensor parallelism as an artifact records it: which weights and pools are split over the
devices of one instance, along which axis, and how each device's part is cut from a weight
file (docs/design.md#tensor-parallelism).

A split weight is described by its axis and its *segments*: the parts fused along that axis in
the file, in order (q | k | v of a fused projection, gate | up of the MLP). Each segment is cut
into one piece per device, and device j's shard is piece j of every segment, concatenated. The
program sees the shards one after another (device 0's, then device 1's ...), so its graph
splits a fused product per device before it splits it into parts (layers.split_fused). A
segment whose pieces are fewer than the devices (a model with fewer KV heads than devices)
gives each piece to `copies` consecutive devices: the program then holds every piece that many
times, and its width along the axis is the segment's width times `copies`.

The loader checks a manifest's splits and the runtimes cut weight files with them, as numpy
arrays or as bytes, neither importing JAX (only `mesh_sharding`, which lowering calls, does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AXIS_NAME = "tp"  # the one mesh axis of a tensor-parallel artifact


@dataclass(frozen=True)
class Segment:
    width: int  # along the split axis, in the file
    copies: int = 1  # devices that hold each piece


@dataclass(frozen=True)
class Split:
    """How one weight or pool is divided over the devices: along `axis`, segment by segment."""

    axis: int
    segments: tuple[Segment, ...]

    def check(self, shape: tuple[int, ...], devices: int, what: str) -> None:
        """Raises ValueError naming `what` unless the split cuts `shape` into equal shards."""
        if not 0 <= self.axis < len(shape):
            raise ValueError(f"{what}: split axis {self.axis} is outside its shape {list(shape)}")
        if sum(s.width for s in self.segments) != shape[self.axis]:
            raise ValueError(f"{what}: segments {[s.width for s in self.segments]} do not add up "
                             f"to axis {self.axis} of {list(shape)}")
        for s in self.segments:
            if s.copies < 1 or devices % s.copies or s.width % (devices // s.copies):
                raise ValueError(f"{what}: a segment of {s.width} does not divide into "
                                 f"{devices // max(s.copies, 1)} pieces held by {s.copies} "
                                 f"device(s) each")

    def program_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the program sees for a file of `shape`: each segment `copies` times."""
        out = list(shape)
        out[self.axis] = sum(s.width * s.copies for s in self.segments)
        return tuple(out)

    def shard_shape(self, shape: tuple[int, ...], devices: int) -> tuple[int, ...]:
        """The shape of one device's part (every device's is the same)."""
        out = list(self.program_shape(shape))
        out[self.axis] //= devices
        return tuple(out)

    def shard_ranges(self, device: int, devices: int) -> list[tuple[int, int]]:
        """Device `device`'s pieces along the axis of the file's tensor: (first, width) of
        each segment's piece, in the order the device holds them."""
        ranges, start = [], 0
        for s in self.segments:
            size = s.width * s.copies // devices
            ranges.append((start + (device // s.copies) * size, size))
            start += s.width
        return ranges

    def shard(self, array, device: int, devices: int):
        """Device `device`'s part of a file's tensor, a numpy array (a memory map reads only
        these slices)."""
        import numpy as np

        pieces = []
        for first, size in self.shard_ranges(device, devices):
            index = [slice(None)] * array.ndim
            index[self.axis] = slice(first, first + size)
            pieces.append(array[tuple(index)])
        return np.ascontiguousarray(np.concatenate(pieces, axis=self.axis))

    def shard_bytes(self, data: bytes | memoryview, shape: tuple[int, ...], itemsize: int,
                    device: int, devices: int) -> bytearray:
        """The same part cut from a file's bytes (C order): for each index before the axis,
        each piece's run of contiguous bytes."""
        inner = itemsize * math.prod(shape[self.axis + 1:])
        row = shape[self.axis] * inner  # one index before the axis
        outer = len(data) // row
        ranges = [(first * inner, size * inner) for first, size in
                  self.shard_ranges(device, devices)]
        view = memoryview(data)
        return bytearray().join(view[o * row + a:o * row + a + n] for o in range(outer)
                                for a, n in ranges)

    def device_pieces(self, devices: int) -> tuple[int, ...]:
        """The widths of one device's pieces, one per segment, in the order the device (and
        the program, device after device) holds them."""
        return tuple(s.width * s.copies // devices for s in self.segments)

    def file_pieces(self, devices: int) -> tuple[int, ...]:
        """The widths of the distinct pieces along the axis in the file's order: each
        segment's, cut for its devices (a piece held by `copies` devices appears once)."""
        return tuple(w for s, w in zip(self.segments, self.device_pieces(devices))
                     for _ in range(devices // s.copies))

    def to_json(self) -> dict:
        return {"axis": self.axis, "segments": [[s.width, s.copies] for s in self.segments]}

    @staticmethod
    def from_json(obj: dict) -> "Split":
        return Split(int(obj["axis"]), tuple(Segment(int(w), int(c)) for w, c in obj["segments"]))


@dataclass(frozen=True)
class TensorParallel:
    """An artifact's tensor parallelism (the manifest's model.tensorParallel): its programs run
    on `devices` devices as one SPMD program; the weights and pools named here are split, every
    other weight is replicated. `kv_head_copies` > 1: fewer KV heads than devices, each KV head
    held by that many devices (its pools and k/v weights repeat it); `key_head_copies`, the
    same for a linear layer's key heads."""

    devices: int
    kv_head_copies: int = 1
    key_head_copies: int = 1
    weights: dict[str, Split] = field(default_factory=dict)
    pools: dict[str, Split] = field(default_factory=dict)

    def partition_axis(self, name: str, pool: bool = False) -> int | None:
        """The split axis of a weight slot (or a pool), None when it is replicated."""
        split = (self.pools if pool else self.weights).get(name)
        return None if split is None else split.axis

    def to_json(self) -> dict:
        return {"devices": self.devices, "meshAxis": AXIS_NAME,
                "kvHeadCopies": self.kv_head_copies, "keyHeadCopies": self.key_head_copies,
                "weights": {k: v.to_json() for k, v in self.weights.items()},
                "pools": {k: v.to_json() for k, v in self.pools.items()}}

    @staticmethod
    def from_json(obj: dict) -> "TensorParallel":
        return TensorParallel(int(obj["devices"]), int(obj.get("kvHeadCopies", 1)),
                              int(obj.get("keyHeadCopies", 1)),
                              {k: Split.from_json(v) for k, v in obj.get("weights", {}).items()},
                              {k: Split.from_json(v) for k, v in obj.get("pools", {}).items()})


def mesh_sharding(devices: int, ndim: int, axis: int | None = None):
    """A tensor of `ndim` dimensions split along `axis` over the one-axis mesh of `devices`
    devices (replicated when `axis` is None), for lowering: the mesh is abstract, so the
    lowering process needs no devices."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    dims = [None] * ndim
    if axis is not None:
        dims[axis] = AXIS_NAME
    return NamedSharding(AbstractMesh((devices,), (AXIS_NAME,)), PartitionSpec(*dims))


def single_split(axis: int, width: int) -> Split:
    """A split of one segment: the axis cut into equal, contiguous shards."""
    return Split(axis, (Segment(width),))


__all__ = ["AXIS_NAME", "Segment", "Split", "TensorParallel", "mesh_sharding", "single_split"]

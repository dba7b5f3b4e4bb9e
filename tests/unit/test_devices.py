"""Splits over devices (artifact/sharding.py) and which devices an instance takes (runtime/pjrt.py),
with no JAX: a device's shard of a fused weight, KV heads held by several devices, the checks a
manifest's split must pass, and the `devices` parameter."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc.runtime.pjrt import instance_devices, with_cpu_devices
from triton_tlaloc.artifact.sharding import Segment, Split, TensorParallel, single_split


def test_a_shard_is_its_piece_of_every_segment():
    # rows: q (4 heads of 1), k (2 heads), v (2 heads), as a fused q|k|v of head size 1
    full = np.arange(8 * 3).reshape(8, 3)
    split = Split(0, (Segment(4), Segment(2), Segment(2)))
    assert [split.shard(full, j, 2)[:, 0].tolist() for j in range(2)] == [
        [0, 3, 12, 18], [6, 9, 15, 21]]  # rows 0,1 | 4 | 6 and 2,3 | 5 | 7
    assert split.program_shape(full.shape) == (8, 3)
    assert split.shard_shape(full.shape, 2) == (4, 3)


def test_a_segment_with_copies_gives_each_piece_to_several_devices():
    full = np.arange(8)
    split = Split(0, (Segment(4), Segment(2, copies=2), Segment(2, copies=2)))
    shards = [split.shard(full, j, 4).tolist() for j in range(4)]
    assert shards == [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]
    assert split.program_shape((8,)) == (12,)  # k and v held twice
    assert split.shard_shape((8,), 4) == (3,)


@pytest.mark.parametrize("split,shape", [
    (Split(0, (Segment(4), Segment(2), Segment(2))), (8, 3)),
    (Split(1, (Segment(8), Segment(4, copies=2), Segment(4, copies=2))), (3, 16, 5)),
    (Split(2, (Segment(6),)), (2, 3, 6)),
])
def test_a_shard_cut_from_the_files_bytes_is_the_arrays_shard(split, shape):
    """The runner with no numpy cuts each device's part from a weight file's bytes: the same
    bytes as the numpy cut (control: the pieces of a neighbouring device differ)."""
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    for device in range(4):
        want = split.shard(array, device, 4).tobytes()
        assert split.shard_bytes(array.tobytes(), shape, 4, device, 4) == want
        assert split.shard_bytes(array.tobytes(), shape, 4, (device + 1) % 4, 4) != want


def test_the_program_sees_the_shards_one_after_another():
    full = np.arange(12).reshape(2, 6)
    split = single_split(1, 6)
    joined = np.concatenate([split.shard(full, j, 3) for j in range(3)], axis=1)
    np.testing.assert_array_equal(joined, full)


@pytest.mark.parametrize("split, shape, devices, message", [
    (single_split(2, 4), (4, 4), 2, "outside its shape"),
    (Split(0, (Segment(3), Segment(2))), (4, 4), 2, "do not add up"),
    (single_split(0, 6), (6, 2), 4, "does not divide into 4 pieces"),
    (Split(0, (Segment(2, copies=3),)), (2, 2), 4, "does not divide"),
])
def test_a_split_that_does_not_cut_equal_shards_is_refused_by_name(split, shape, devices,
                                                                    message):
    with pytest.raises(ValueError, match=message):
        split.check(shape, devices, "weight w")


def test_the_manifest_record_round_trips():
    tp = TensorParallel(4, 2, 1, {"layers.qkv": Split(1, (Segment(64), Segment(32, 2)))},
                        {"layers.k": single_split(3, 4)})
    assert TensorParallel.from_json(tp.to_json()) == tp
    assert tp.partition_axis("layers.qkv") == 1 and tp.partition_axis("embed") is None
    assert tp.partition_axis("layers.k", pool=True) == 3


def test_an_instance_takes_its_group_of_the_devices():
    assert instance_devices("", 1, 3, device=5) == (5,)  # Triton's KIND_GPU placement
    assert instance_devices("", 2, 1, device=0) == (2, 3)
    assert instance_devices("", 2, 1, device=0, own_client=True) == (0, 1)  # CPU processes
    assert instance_devices("4,5,6,7", 2, 1, device=0) == (6, 7)
    with pytest.raises(ValueError, match="instance 2 needs devices 4..5 of the list"):
        instance_devices("0,1,2,3", 2, 2, device=0)
    with pytest.raises(ValueError, match="comma-separated device numbers"):
        instance_devices("0,gpu1", 2, 0, device=0)


def test_the_cpu_device_count_replaces_any_other():
    flag = "--xla_force_host_platform_device_count"
    assert with_cpu_devices("", 4) == f"{flag}=4"
    assert with_cpu_devices(f"--xla_dump_to=/tmp/x {flag}=2", 8) == (
        f"--xla_dump_to=/tmp/x {flag}=8")

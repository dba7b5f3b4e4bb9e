"""lora/registry.py: adapters by name in the pools' slots, with a fake reader and writer and an
injected clock. A slot is shared by the sequences of one adapter, given to another adapter only
when no live sequence uses it (the least recently used first), never while in use (the caller
waits); adapters kept in host memory within a budget; unknown names, bad names, a second load
of a name and the unloading of an adapter in use refused by name, nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc.lora.peft_adapter import AdapterError, LoraAdapter
from triton_tlaloc.lora.registry import AdapterRegistry, AdapterSlotsBusy


class Files:
    """Adapters by path, 1 KiB each; counts reads and slot writes."""

    def __init__(self):
        self.reads, self.writes = [], []

    def read(self, path):
        if "bad" in str(path):
            raise AdapterError(f"adapter {path}: DoRA (use_dora) is not served")
        self.reads.append(path.name)
        return LoraAdapter(str(path), {"lora.o.a": np.zeros(256, np.float32)}, 4,
                           f"hash-{path.name}")

    def write(self, slot, arrays):
        self.writes.append(slot)
        return 0.01


def registry(slots=2, budget=2048):
    files, now = Files(), [0.0]
    reg = AdapterRegistry(slots, files.read, files.write, budget, clock=lambda: now[0])
    for name in "abcd":
        reg.register(name, f"/adapters/{name}")
    return reg, files, now


def test_adapters_share_slots_and_wait_when_every_slot_is_in_use():
    reg, files, now = registry()
    assert reg.acquire("a") == (1, "hash-a")
    assert reg.acquire("a") == (1, "hash-a")  # the same slot, not written again
    assert reg.acquire("b") == (2, "hash-b")
    assert files.writes == [1, 2] and reg.on_device == 2
    with pytest.raises(AdapterSlotsBusy, match="every one of the 2 adapter slots"):
        reg.acquire("c")
    assert reg.in_slot[1:] == ["a", "b"] and reg.users[1:] == [2, 1]  # nothing changed
    reg.release(2)
    now[0] = 1.0
    assert reg.acquire("c") == (2, "hash-c")  # b's slot, unused
    assert reg.stats.evictions == 1 and reg.stats.loads == 3
    reg.release(1)
    reg.release(1)
    reg.release(2)
    now[0] = 2.0
    reg.acquire("c")  # c touched: a is the least recently used
    reg.release(2)
    now[0] = 3.0
    assert reg.acquire("d") == (1, "hash-d")
    assert reg.stats.rows == {"a": 2, "b": 1, "c": 2, "d": 1}


def test_host_memory_keeps_what_fits_and_reads_again_what_it_dropped():
    reg, files, _ = registry(slots=1, budget=2048)  # two adapters of 1 KiB fit
    assert files.reads == ["a", "b", "c", "d"] and list(reg.host) == ["c", "d"]
    assert reg.stats.host_evictions == 2
    reg.acquire("c")  # kept: not read again
    assert files.reads == ["a", "b", "c", "d"]
    reg.release(1)
    reg.acquire("a")  # dropped: read again
    assert files.reads[-1] == "a" and list(reg.host) == ["c", "a"]


def test_refusals_change_nothing():
    reg, files, _ = registry()
    with pytest.raises(AdapterError, match=r"unknown adapter 'zz' \(loaded: a, b, c, d\)"):
        reg.acquire("zz")
    with pytest.raises(AdapterError, match="adapter name '-x'"):
        reg.register("-x", "/adapters/x")
    with pytest.raises(AdapterError, match="adapter a is loaded already"):
        reg.register("a", "/adapters/other")
    with pytest.raises(AdapterError, match="DoRA"):
        reg.register("e", "/adapters/bad")
    assert reg.names == ["a", "b", "c", "d"]
    slot, _ = reg.acquire("a")
    with pytest.raises(AdapterError, match="adapter a is in use by 1 live sequence"):
        reg.unregister("a")
    reg.release(slot)
    reg.unregister("a")
    assert reg.names == ["b", "c", "d"] and reg.slot_of("a") == 0 and "a" not in reg.host
    with pytest.raises(AssertionError):
        reg.release(slot)  # no sequence holds it


def test_loads_and_unloads_while_serving_come_only_from_under_the_updates_root(tmp_path):
    files = Files()
    off = AdapterRegistry(2, files.read, files.write, 1 << 20)
    with pytest.raises(AdapterError, match="loading adapters while serving is off"):
        off.update({"load": {"name": "x", "path": "x"}})
    root = tmp_path / "adapters"
    reg = AdapterRegistry(2, files.read, files.write, 1 << 20, updates_root=root)
    assert reg.update({"load": {"name": "x", "path": "x"}}) == "adapter x loaded (rank 4)"
    assert reg.paths["x"] == (root / "x").resolve()
    for path in ("../elsewhere", str(tmp_path / "elsewhere"), "x/../../y"):
        with pytest.raises(AdapterError, match="is outside the directory adapters may be"):
            reg.update({"load": {"name": "y", "path": path}})
    for bad in ({"load": {"name": "y"}}, {"unload": 3}, {"drop": "x"}, {}):
        with pytest.raises(AdapterError, match="lora_admin"):
            reg.update(bad)
    slot, _ = reg.acquire("x")
    with pytest.raises(AdapterError, match="in use by 1 live sequence"):
        reg.update({"unload": "x"})
    reg.release(slot)
    assert reg.update({"unload": "x"}) == "adapter x unloaded" and reg.names == []


def test_paths_and_names_the_system_refuses_are_refused_by_name(tmp_path):
    """A NUL in a load's path (realpath raises ValueError on it), a path too long, an unload of
    a malformed name, and a reader failing with OSError: each an AdapterError naming it,
    nothing changed."""
    files = Files()
    reg = AdapterRegistry(2, files.read, files.write, 1 << 20, updates_root=tmp_path)
    for command, message in (({"load": {"name": "x", "path": "a\0b"}}, r"U\+0000"),
                             ({"load": {"name": "x", "path": "p" * 5000}}, "1 to 4096"),
                             ({"load": {"name": "x", "path": ""}}, "1 to 4096"),
                             ({"load": {"name": "a\0b", "path": "x"}}, "adapter name"),
                             ({"unload": "\0"}, "adapter name")):
        with pytest.raises(AdapterError, match=message):
            reg.update(command)

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))
    reg.read = unreadable
    with pytest.raises(AdapterError, match="adapter x: .*Permission denied"):
        reg.update({"load": {"name": "x", "path": "x"}})
    assert reg.names == [] and files.reads == []


def test_lora_admin_is_obeyed_only_with_the_servers_admin_key():
    """The sequence model's request parameter lora_admin, checked where the request arrives:
    whoever reaches Triton's inference port may send it, so without the server's admin key
    (none configured, missing, wrong) it is refused by name; with it, a malformed command is
    refused there too, before the batching thread sees it."""
    from triton_tlaloc.triton.adapters import lora_admin_parameter

    unload = {"lora_admin": '{"unload": "tenant"}'}
    assert lora_admin_parameter({}, None) is None and lora_admin_parameter({}, "k") is None
    with pytest.raises(AdapterError, match="this server has none"):
        lora_admin_parameter({**unload, "lora_admin_key": "k"}, None)
    for given in ({}, {"lora_admin_key": "wrong"}, {"lora_admin_key": 7}):
        with pytest.raises(AdapterError, match="lora_admin_key\\) is missing or wrong"):
            lora_admin_parameter({**unload, **given}, "k")
    assert lora_admin_parameter({**unload, "lora_admin_key": "k"}, "k") == {"unload": "tenant"}
    for bad, message in (('{"load": {"name": "e", "path": "a\\u0000b"}}', r"U\+0000"),
                         ("not json", "expected a JSON object"), ("[1]", "expected")):
        with pytest.raises(AdapterError, match=message):
            lora_admin_parameter({"lora_admin": bad, "lora_admin_key": "k"}, "k")

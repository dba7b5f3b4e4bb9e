"""Adapters by name, and which of them the device holds: the adapter pools' slots (slot 0 is no
adapter), each holding one adapter and counting the live sequences that use it; adapters read
from disk kept in host memory within a byte budget (least recently used out), so one that comes
back is written into a slot without reading its files again.

A sequence that names an adapter acquires a slot for its life (`acquire`) and gives it back at
its end (`release`). An adapter not in a slot is written into a free one, or into the slot of
the least recently used adapter no live sequence uses; when every slot is in use the caller
waits (AdapterSlotsBusy), as a request short of pages does. A slot in use is never replaced,
and an adapter in use cannot be unloaded (refused by name). Pure Python: the reading and the
slot writes are injected (lora/peft_adapter.py, runtime/adapter_pools.py)."""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .peft_adapter import AdapterError, LoraAdapter

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


# The longest adapter path a load names (Linux's PATH_MAX)
MAX_PATH_CHARS = 4096


def checked_admin_command(command) -> tuple[str, object]:
    """A load or unload command's verb and argument, its shape checked (the front end checks it
    before the request is queued, the registry again before it acts): ("unload", NAME) or
    ("load", {"name", "path"}); AdapterError naming what is wrong."""
    if not isinstance(command, dict) or len(command) != 1:
        raise AdapterError("lora_admin: expected {\"load\": {\"name\": ..., \"path\": "
                           "...}} or {\"unload\": name}")
    (verb, arg), = command.items()
    if verb == "unload" and isinstance(arg, str):
        _checked_name(arg)
        return verb, arg
    if verb == "load" and isinstance(arg, dict) and set(arg) == {"name", "path"} and all(
            isinstance(v, str) for v in arg.values()):
        _checked_name(arg["name"])
        path = arg["path"]
        if not path or "\0" in path or len(path) > MAX_PATH_CHARS:
            raise AdapterError(f"lora_admin: adapter path {path[:200]!r}: expected a "
                               f"directory's path, without U+0000, of 1 to {MAX_PATH_CHARS} "
                               f"characters")
        return verb, arg
    raise AdapterError(f"lora_admin: {str(verb)[:100]!r}: expected load {{name, path}} or "
                       f"unload NAME")


def _checked_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name[:200]!r}: letters, digits and . _ : / - (up to "
                           f"128, not starting with punctuation)")


class AdapterSlotsBusy(Exception):
    """Every slot holds an adapter that a live sequence uses: wait for one to end."""


@dataclass
class AdapterStats:
    loads: int = 0  # adapters written into a slot
    evictions: int = 0  # adapters whose slot was given to another
    host_evictions: int = 0  # adapters dropped from host memory for the budget
    load_seconds: float = 0.0
    rows: dict[str, int] = field(default_factory=dict)  # sequences started, by adapter name


class AdapterRegistry:
    """`slots`: the pools' slots besides slot 0; `read(path)` an adapter's arrays
    (peft_adapter.read_peft_adapter against the artifact's layout); `write(slot, arrays)` into
    the device (AdapterPools.write; None clears); `host_budget` bytes of read adapters kept."""

    def __init__(self, slots: int, read: Callable[[Path], LoraAdapter],
                 write: Callable[[int, dict | None], float], host_budget: int,
                 clock: Callable[[], float] = time.monotonic,
                 updates_root: str | Path | None = None):
        assert slots >= 1, slots
        self.read, self.write, self.clock = read, write, clock
        self.host_budget = host_budget
        # adapters may be loaded and unloaded while serving only from under this directory
        # (None: not at all)
        self.updates_root = Path(updates_root).resolve() if updates_root else None
        self.paths: dict[str, Path] = {}
        self.hashes: dict[str, str] = {}  # each adapter's identity (its files' hash)
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.in_slot: list[str | None] = [None] * (slots + 1)  # slot 0: none, always
        self.users = [0] * (slots + 1)
        self.last_used = [0.0] * (slots + 1)
        self.stats = AdapterStats()

    # ------------------------------------------------------------ names

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Know `name` as the adapter in `path`, read and checked now (an adapter that does
        not fit is refused here, by name, and nothing changes)."""
        _checked_name(name or "")
        if name in self.paths:
            raise AdapterError(f"adapter {name} is loaded already (from {self.paths[name]}); "
                               f"unload it first")
        try:
            adapter = self.read(Path(path))
        except AdapterError:
            raise
        except (OSError, ValueError) as e:  # a path the system refuses, unreadable files
            raise AdapterError(f"adapter {name}: {path!s:.200}: {e}") from None
        self.paths[name] = Path(path)
        self.hashes[name] = adapter.content_hash
        self._keep_on_host(name, adapter)
        return adapter

    def unregister(self, name: str) -> None:
        """Forget `name`; refused while a live sequence uses it."""
        self._known(name)
        slot = self.slot_of(name)
        if slot and self.users[slot]:
            raise AdapterError(f"adapter {name} is in use by {self.users[slot]} live "
                               f"sequence(s): unload it when they end")
        if slot:
            self.in_slot[slot] = None
        self.host.pop(name, None)
        del self.paths[name], self.hashes[name]

    def update(self, command: dict) -> str:
        """A load or unload while serving ({"load": {"name", "path"}} or {"unload": name}):
        what was done, or AdapterError naming why not (updates off, a path outside the
        updates root, an adapter in use, ...), nothing changed."""
        if self.updates_root is None:
            raise AdapterError("loading adapters while serving is off (the model parameter "
                               "lora_updates_root names the directory they may come from)")
        verb, arg = checked_admin_command(command)
        if verb == "unload":
            self.unregister(arg)
            return f"adapter {arg} unloaded"
        path = (self.updates_root / arg["path"]).resolve()
        if not path.is_relative_to(self.updates_root):
            raise AdapterError(f"adapter path {arg['path']!r} is outside the directory "
                               f"adapters may be loaded from")
        adapter = self.register(arg["name"], path)
        return f"adapter {arg['name']} loaded (rank {adapter.rank})"

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    def slot_of(self, name: str) -> int:
        """The slot holding `name`, 0 when none does."""
        return next((s for s, n in enumerate(self.in_slot) if s and n == name), 0)

    # ------------------------------------------------------------ slots

    def acquire(self, name: str) -> tuple[int, str]:
        """A slot holding `name` for one more live sequence, and the adapter's identity (its
        content hash): the slot it is in, or one it is written into now. AdapterError for an
        unknown name; AdapterSlotsBusy when every slot is in use."""
        self._known(name)
        slot = self.slot_of(name)
        if not slot:
            slot = self._free_slot()
            adapter = self._adapter(name)
            self.stats.load_seconds += self.write(slot, adapter.arrays)
            self.stats.loads += 1
            if self.in_slot[slot] is not None:
                self.stats.evictions += 1
            self.in_slot[slot] = name
        self.users[slot] += 1
        self.last_used[slot] = self.clock()
        self.stats.rows[name] = self.stats.rows.get(name, 0) + 1
        return slot, self.hashes[name]

    def release(self, slot: int) -> None:
        """A live sequence using `slot` ended."""
        assert slot > 0 and self.users[slot] > 0, (slot, self.users)
        self.users[slot] -= 1
        self.last_used[slot] = self.clock()

    @property
    def on_device(self) -> int:
        return sum(n is not None for n in self.in_slot)

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used slot no live sequence uses."""
        empty = [s for s in range(1, len(self.in_slot)) if self.in_slot[s] is None]
        if empty:
            return empty[0]
        idle = [s for s in range(1, len(self.in_slot)) if not self.users[s]]
        if not idle:
            raise AdapterSlotsBusy(f"every one of the {len(self.in_slot) - 1} adapter slots "
                                   f"holds an adapter a live sequence uses")
        return min(idle, key=lambda s: self.last_used[s])

    def _adapter(self, name: str) -> LoraAdapter:
        """The adapter's arrays: from host memory, or read again."""
        adapter = self.host.get(name)
        if adapter is None:
            adapter = self.read(self.paths[name])
            self._keep_on_host(name, adapter)
        else:
            self.host.move_to_end(name)
        return adapter

    def _keep_on_host(self, name: str, adapter: LoraAdapter) -> None:
        self.host[name] = adapter
        self.host.move_to_end(name)
        while sum(a.nbytes for a in self.host.values()) > self.host_budget and len(self.host) > 1:
            self.host.popitem(last=False)
            self.stats.host_evictions += 1

    def _known(self, name: str) -> None:
        if name not in self.paths:
            known = ", ".join(self.names) or "none"
            raise AdapterError(f"unknown adapter {name!r} (loaded: {known})")


def parse_adapters(text: str) -> dict[str, str]:
    """The lora_adapters parameter, NAME=DIR,NAME=DIR, as {NAME: DIR}."""
    out = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise AdapterError(f"lora_adapters: {item!r} is not NAME=DIR")
        out[name] = directory
    return out


__all__ = ["AdapterRegistry", "AdapterSlotsBusy", "AdapterStats", "checked_admin_command",
           "parse_adapters"]

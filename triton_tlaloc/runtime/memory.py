"""The serving process's resident memory, counted by phase of a load (docs/performance.md#memory).

What a model holds after load is measured, not estimated: the resident set size read before and
after each phase (the executables compiled or loaded, the weights, the pools) gives each its
share, and the load log prints them. Two facts shape the numbers on XLA's CPU backend:

- A loaded executable holds host memory for each kernel XLA emitted (about 90 KB a fused
  kernel with jaxlib 0.7.1), so an entry of a model whose layers are unrolled costs tens of MB
  whatever its batch or context, and the executables, not the weights, are most of a model's
  memory when the ladder has many entries; the layer loop (export/layers.py) keeps one layer's
  kernels an entry.
- A compile allocates and frees far more than it keeps; glibc keeps freed heap pages resident
  unless asked to give them back, so each compile is followed by `release_freed`.

Pure Python: Linux's /proc is read when it is there, and nothing is measured elsewhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable

_RELEASE_LOCK = threading.Lock()
_malloc_trim = None


def resident_bytes() -> int | None:
    """This process's resident set size, or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_freed() -> None:
    """Give the heap pages freed so far back to the system (glibc's malloc_trim); a no-op on
    other C libraries, or with TLALOC_RELEASE_FREED=0 (the measurement's control)."""
    global _malloc_trim
    if os.environ.get("TLALOC_RELEASE_FREED", "1") == "0":
        return
    with _RELEASE_LOCK:
        if _malloc_trim is None:
            try:
                _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            except (OSError, AttributeError):
                _malloc_trim = False
        if _malloc_trim:
            _malloc_trim(0)


class MemoryLedger:
    """Resident memory before a load and what each phase added (`mark` after each)."""

    def __init__(self, read: Callable[[], int | None] = resident_bytes,
                 release: Callable[[], None] = release_freed):
        self._read, self._release = read, release
        self._lock = threading.Lock()
        self.start = read()
        self._last = self.start
        self.phases: list[tuple[str, int]] = []

    @property
    def measured(self) -> bool:
        return self.start is not None

    @property
    def total(self) -> int | None:
        return self._last

    def mark(self, phase: str) -> int | None:
        """Freed pages released, then what `phase` added since the last mark (None when
        nothing can be measured)."""
        self._release()
        with self._lock:
            now = self._read()
            if now is None or self._last is None:
                return None
            added = now - self._last
            self.phases.append((phase, added))
            self._last = now
            return added

    def summary(self) -> str:
        if not self.measured:
            return "resident memory not measured on this platform"
        gb = 2**30
        parts = [f"{self.start / gb:.2f} GB before load"]
        parts += [f"{phase} {added / gb:+.2f} GB" for phase, added in self.phases]
        return f"resident memory {self._last / gb:.2f} GB: " + ", ".join(parts)


__all__ = ["resident_bytes", "release_freed", "MemoryLedger"]

"""`tlaloc compile`: fill the compile cache with an artifact's executables for this machine's
platform before any server starts (a container image's build step, or `tlaloc export
--precompile`), so a deployment pays compile time once, at build time.

Every entry is compiled (in `compiling.compile_order`, on worker threads) and so are the host
tier's page transfer programs, each through `compile_cache.compile_cached`: the key is the program's
text, the platform and its version, and the jax/jaxlib versions, so a server on the same
machine and versions loads each from the cache instead of compiling it. Progress goes to a
callback, one line per program with an estimate of the time left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .compiling import compile_order, compile_workers
from ..artifact.manifest import Artifact
from .pjrt import PjrtDevice, open_devices
from .compile_cache import CompileStats, compile_cached, default_cache_dir


@dataclass
class _CompileOnly:
    """What the page transfer programs need of a runtime to compile (no weights, no pools)."""

    artifact: Artifact
    device: PjrtDevice
    cache_dir: Path
    use_cache: bool = True


class Progress:
    """`done / total` lines with the elapsed time and an estimate of what is left."""

    def __init__(self, total: int, say: Callable[[str], None], clock=time.perf_counter):
        self.total, self.say, self.clock = total, say, clock
        self.done = 0
        self.started = clock()
        self._lock = threading.Lock()

    def step(self, what: str, how: str) -> None:
        with self._lock:
            self.done += 1
            elapsed = self.clock() - self.started
            left = elapsed / self.done * (self.total - self.done)
            width = len(str(self.total))
            self.say(f"[{self.done:>{width}}/{self.total}] {what}: {how} "
                     f"({elapsed:.0f} s elapsed, ~{left:.0f} s left)")


def precompile(artifact: Artifact, *, platform: str = "cpu", cache_dir: Path | None = None,
               workers: int | None = None, transfers: bool = True,
               say: Callable[[str], None] = print) -> CompileStats:
    """Compile every entry of `artifact` (and the page transfer programs) into the compile
    cache; returns how many were compiled and how many were there already."""
    from .kv_transfer import PageTransfer, transfer_buckets

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    device = open_devices(artifact, platform, 0, None)
    stats = CompileStats()
    names = compile_order(artifact, artifact.entries)
    progress = Progress(len(names) + (1 if transfers else 0), say)
    say(f"compiling {len(names)} entries of {artifact.model.model_name} for {platform} into "
        f"{cache_dir} on {workers or compile_workers()} threads")

    def one(name: str) -> None:
        mine = CompileStats()  # this entry's: was it in the cache already
        compile_cached(device, artifact.body_text(artifact.entries[name]), f"entry {name}",
                       cache_dir, True, mine)
        stats.add(mine.compiled, mine.cache_hits, mine.seconds)
        progress.step(f"entry {name}", "in the cache already" if mine.cache_hits
                      else f"compiled in {mine.seconds:.1f} s")

    with ThreadPoolExecutor(workers or compile_workers(), "tlaloc-precompile") as pool:
        for future in [pool.submit(one, n) for n in names]:
            future.result()  # a failed compile raises here, naming its entry
    if transfers:
        t0 = time.perf_counter()
        transfer = PageTransfer(_CompileOnly(artifact, device, cache_dir))
        transfer.warm(transfer_buckets(artifact))
        t = transfer.compile_stats
        stats.add(t.compiled, t.cache_hits, t.seconds)
        progress.step("page transfer programs", f"{t.compiled + t.cache_hits} programs "
                      f"({t.cache_hits} in the cache already) in "
                      f"{time.perf_counter() - t0:.1f} s")
    return stats


__all__ = ["Progress", "precompile"]

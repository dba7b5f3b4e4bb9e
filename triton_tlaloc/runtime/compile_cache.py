"""The on-disk compile cache: an executable for a program's StableHLO text, compiled once and
then loaded, keyed by the text and the device's identity (`cache_identity`: the client, its
platform and version, and the devices), whichever runtime compiles it (JAX's client, pjrt.py;
a plugin's C API, capi.py). Imports neither JAX nor numpy.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .memory import release_freed

log = logging.getLogger("triton_tlaloc.runtime")


def default_cache_dir() -> Path:
    env = os.environ.get("TLALOC_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "triton-tlaloc" / "compile"


@dataclass
class CompileStats:
    compiled: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    refused: int = 0  # cache files found but not loaded (damaged, stale): compiled instead
    # Compile threads share one (the background compiles, `tlaloc compile`'s workers).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, compiled: int = 0, cache_hits: int = 0, seconds: float = 0.0,
            refused: int = 0) -> None:
        with self._lock:
            self.compiled += compiled
            self.cache_hits += cache_hits
            self.seconds += seconds
            self.refused += refused


# A cache file is this header, the sha256 of the serialized executable, then the executable.
# PJRT deserializes damaged bytes without complaint, and an executable loaded from them can
# crash the process on its first call: only bytes whose digest matches are ever loaded.
CACHE_MAGIC = b"tlaloc-pjrt-1\n"


def framed(blob: bytes) -> bytes:
    """A serialized executable as the compile cache stores it: header, digest, bytes."""
    return CACHE_MAGIC + hashlib.sha256(blob).digest() + blob


def unframed(data: bytes) -> bytes:
    """The serialized executable a cache file holds; ValueError naming what is wrong when the
    header is missing (a file of an older release) or the digest does not match."""
    if not data.startswith(CACHE_MAGIC):
        raise ValueError("no checksum header (written by an older release, or not a cache file)")
    start = len(CACHE_MAGIC) + 32
    digest, blob = data[len(CACHE_MAGIC):start], data[start:]
    if hashlib.sha256(blob).digest() != digest:
        raise ValueError("checksum mismatch: the file is damaged")
    return blob


def compile_cached(device, text: str, what: str, cache_dir: Path,
                   use_cache: bool = True, stats: CompileStats | None = None):
    """An executable for StableHLO text: from the compile cache when it holds one for this text
    and platform whose checksum matches, else compiled (and stored, written to a temporary name
    then renamed so a concurrent reader never sees half a file). A file that fails its checksum
    or does not load is a logged cache miss, replaced by the new compile.

    Processes sharing the cache compile a program once: the first to want it holds a lock on
    its key (flock, released by the kernel if the process dies) while it compiles, and the
    others wait, then load it (a model's instances, each a process, start on the same entries
    at the same moment and used to compile each one once apiece)."""
    key = hashlib.sha256(f"{hashlib.sha256(text.encode()).hexdigest()}|"
                         f"{device.cache_identity}".encode()).hexdigest()
    cached = cache_dir / f"{key}.pjrt"
    stats = stats if stats is not None else CompileStats()
    if not use_cache:
        return _load_or_compile(device, text, what, cached, False, stats)
    try:
        lock = _open_lock(cache_dir, key)
    except OSError as e:  # a cache that cannot be written (a read-only image's): no lock
        log.debug("%s: compile cache %s cannot be locked (%s)", what, cache_dir, e)
        return _load_or_compile(device, text, what, cached, True, stats)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _load_or_compile(device, text, what, cached, True, stats)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _open_lock(cache_dir: Path, key: str):
    cache_dir.mkdir(parents=True, exist_ok=True)
    return open(cache_dir / f"{key}.lock", "a")


def _load_or_compile(device, text: str, what: str, cached: Path, use_cache: bool,
                     stats: CompileStats):
    t0 = time.perf_counter()
    if use_cache and cached.is_file():
        try:
            exe = device.deserialize(unframed(cached.read_bytes()))
            stats.add(cache_hits=1, seconds=time.perf_counter() - t0)
            release_freed()  # what deserializing allocated and freed
            log.info("%s: loaded from the compile cache in %.2f s", what,
                     time.perf_counter() - t0)
            return exe
        except Exception as e:  # a damaged, stale or torn cache file: compile again
            stats.add(refused=1)
            log.warning("%s: compile cache file %s refused (%s); compiling", what, cached, e)
    exe = device.compile(text)
    stats.add(compiled=1, seconds=time.perf_counter() - t0)
    log.info("%s: compiled in %.2f s", what, time.perf_counter() - t0)
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(framed(device.serialize(exe)))
        tmp.replace(cached)
    release_freed()  # a compile frees most of what it allocates: give it back
    return exe

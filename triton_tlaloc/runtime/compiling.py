"""Which entries to compile before a model is ready, in what order the rest follow, and the
threads that compile them in the background (docs/design.md#compiling-and-running).

A model is ready once the entries a first request needs are compiled (`first_entries`: the
smallest context's single-row decode entry and its single-row prefill entry taking the most
tokens a call there takes: the whole context, or a chunk of it when the export chunks prompts). The rest compile on worker threads in `compile_order`: decode before prefill at each
context (a conversation makes one decode call per token), smaller contexts and batches first,
then the mixed entries (a prompt's chunk with the decode rows in one call), and the verify
entries of speculative decoding after all of them (a server serves plain calls first; mixed
steps and speculation are only faster).
A call that needs an entry not compiled yet asks for it (`want`: it goes to the front of the
queue) and runs on a compiled entry that holds it meanwhile, or waits for it (`wait_for`; the
batcher's thread never waits: it holds the call back and serves others, batcher.py).
Pure Python: the compile itself is injected.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ..artifact.manifest import DECODE, MIXED, PREFILL, VERIFY, Artifact, Entry

log = logging.getLogger("triton_tlaloc.compiling")


def first_entries(art: Artifact) -> list[str]:
    """The entries a first request needs: a prompt within the smallest context and its decode
    steps, one sequence at a time (never a verify entry: a request can always decode plainly)."""
    c = min(art.context_ladder)
    # A prompt runs in calls of at most this many tokens at the smallest context: the context
    # itself, or the export's prefill chunk when that is smaller (asking for a whole context's
    # tokens there would find no prefill entry, and a server ready with none could not take a
    # prompt).
    most = max((e.tokens_per_seq for e in art.entries.values()
                if e.kind == PREFILL and e.context == c), default=c)
    first = [art.smallest_entry(DECODE, 1, c), art.smallest_entry(PREFILL, 1, c, most)]
    return sorted({e.name for e in first if e is not None})


def compile_order(art: Artifact, names) -> list[str]:
    """`names` in the order they are worth compiling: smaller contexts first (every request
    fits them while it is short), decode before prefill at each, then fewer rows, then fewer
    tokens; the mixed entries after all the decode and prefill entries, and every verify entry
    after those, in the same order among themselves (plain calls serve every request: a mixed
    step or speculation is only faster)."""
    later = {MIXED: 1, VERIFY: 2}

    def value(e: Entry):
        return (later.get(e.kind, 0), e.context, e.kind != DECODE, e.batch, e.tokens_per_seq)
    return [e.name for e in sorted((art.entries[n] for n in names), key=value)]


def compile_workers() -> int:
    """Worker threads for background compiles: one core is left to serving."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


class BackgroundCompiler:
    """Compiles `names` (in order) on `workers` threads; each executable is handed to
    `compiled(name, executable)` as it is made. `want` moves a name to the front;
    `wait_for` blocks until it is compiled."""

    def __init__(self, names: list[str], compile_one: Callable[[str], object],
                 compiled: Callable[[str, object], None], workers: int = 1):
        self.total = len(names)
        self._names = frozenset(names)
        self._queue = list(names)
        self._compile_one = compile_one
        self._compiled = compiled
        self._cond = threading.Condition()
        self._done: set[str] = set()
        self._failed: dict[str, BaseException] = {}
        self._stop = False
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._threads = [threading.Thread(target=self._work, name=f"tlaloc-compile-{i}",
                                          daemon=True) for i in range(max(1, workers))]

    def start(self) -> BackgroundCompiler:
        self.started = time.perf_counter()
        if not self._queue:
            self.finished = self.started
        for t in self._threads:
            t.start()
        return self

    @property
    def done(self) -> int:
        return len(self._done)

    def pending(self, name: str) -> bool:
        """Whether `name` is one of these compiles and has neither finished nor failed."""
        with self._cond:
            return name in self._names and name not in self._done and name not in self._failed

    def want(self, name: str) -> None:
        """Compile `name` next (a call is waiting for it, or running on a larger entry)."""
        with self._cond:
            if name in self._queue and self._queue[0] != name:
                self._queue.remove(name)
                self._queue.insert(0, name)
                log.info("entry %s asked for by a request: compiled next", name)

    def wait_for(self, name: str) -> None:
        """Block until `name` is compiled; raises what its compile raised."""
        self.want(name)
        with self._cond:
            while name not in self._done and name not in self._failed:
                self._cond.wait()
            if name in self._failed:
                raise RuntimeError(f"entry {name} failed to compile: {self._failed[name]}")

    def wait_all(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.finished is not None, timeout_s)

    def stop(self) -> None:
        """Compile nothing more (the model is unloading); a compile under way finishes."""
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stop or not self._queue:
                    return
                name = self._queue.pop(0)
            try:
                self._compiled(name, self._compile_one(name))
                failed = None
            except Exception as e:  # logged; a call that needs it gets the error
                log.error("entry %s failed to compile: %s", name, e)
                failed = e
            with self._cond:
                if failed is None:
                    self._done.add(name)
                else:
                    self._failed[name] = failed
                if len(self._done) + len(self._failed) == self.total:
                    self.finished = time.perf_counter()
                    log.info("background compiles done: %d entries in %.1f s%s", self.total,
                             self.finished - self.started,
                             f", {len(self._failed)} failed" if self._failed else "")
                self._cond.notify_all()

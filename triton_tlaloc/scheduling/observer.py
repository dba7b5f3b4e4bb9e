"""What the batcher reports: `Observer` is what the batcher calls after each call, refusal and
reclamation; `BatcherStats` (its own counters), `TimingLog` (one JSON line per call) and
triton/model_metrics.TritonMetrics (the Prometheus metrics, applied off the batcher's thread
by triton/metrics.MetricsWriter) are observers. `CallTiming` takes one call's time apart.
Pure Python."""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass


@dataclass
class CallTiming:
    """Where one call's time went, in seconds (the step profile, scripts/step_profile.py): the
    longest wait of its requests (arrival in execute() to the start of its round), admission of
    the round's requests, building the step inputs, putting them on the device, the executable,
    the logits copy, the replies (responses built and sent), and the rest (the engine's own
    bookkeeping). `total` is admission to the last reply sent."""

    kind: str
    entry: str
    rows: int
    tokens: int
    wait: float
    admit: float
    build: float
    inputs: float
    execute: float
    copy: float
    respond: float
    other: float
    total: float

    PHASES = ("wait", "admit", "build", "inputs", "execute", "copy", "respond", "other")

    def to_json(self) -> dict:
        return {"kind": self.kind, "entry": self.entry, "rows": self.rows, "tokens": self.tokens,
                **{f"{k}_ms": round(getattr(self, k) * 1e3, 4) for k in (*self.PHASES, "total")}}


class Observer:
    """What the batcher reports; every method is optional (a no-op here)."""

    def call(self, kind: str, entry: str, rows: int, tokens: int, waits_s: list[float],
             seconds: float, executions: int = 1) -> None:
        pass

    def refusal(self, reason: str) -> None:
        pass

    def reclaimed(self, sequences: int, pages: int) -> None:
        pass

    def state(self, pools: dict[str, tuple[int, int, int]], sequences: int) -> None:
        """pools: name -> (pages held by live sequences, cached, free)."""

    def prefix(self, queried: int, reused: int, continued: bool, from_host: int = 0) -> None:
        """A START's prompt of `queried` tokens (0 with prefix reuse off) found `reused`
        cached, `from_host` of them on the host tier; `continued`: it took over an ended
        sequence whole."""

    def evicted(self, pages: int, sequences: int) -> None:
        """Cached pages evicted and ended sequences dropped since the last report."""

    def swapped(self, direction: str, nbytes: int, seconds: float) -> None:
        """A sequence's KV moved to the host ("out") or back ("in")."""

    def preempted(self) -> None:
        """A sequence with a request waiting was swapped out to make room."""

    def recomputed(self) -> None:
        """A sequence's KV was dropped to make room (the host tier full): its next request
        computes it again."""

    def held_back(self, kind: str) -> None:
        """A call (decode, prefill or verify) held back until an entry it needs compiles."""

    def speculation(self, drafted: int, accepted: int, steps: int) -> None:
        """A verify call's `steps` rows checked `drafted` draft tokens and accepted `accepted`
        of them (each row also yields the model's own next token)."""

    def nonfinite(self, kind: str, rows: int) -> None:
        """A call of `kind` gave `rows` rows whose logits hold NaN or infinity (answered with
        an error, not the logits)."""

    def host(self, nbytes: int, sequences: int, cached_bytes: int = 0) -> None:
        """The host tier now: bytes held for swapped-out sequences, how many, and bytes of
        evicted blocks kept."""

    def step(self, prompt_tokens: int, decode_tokens: int) -> None:
        """One execution's tokens: of prompts (prefill, a mixed call's chunk) and of decode
        and verify rows."""

    def prompt_started(self, wait_s: float) -> None:
        """A prompt's first tokens ran, `wait_s` after it arrived."""

    def timing(self, t: CallTiming) -> None:
        pass


class TimingLog(Observer):
    """One JSON line per call (CallTiming) appended to a file: the backend's timing log, read
    by scripts/step_profile.py and scripts/step_timeline.py. Each line also holds `end_s`, the
    wall clock (Unix seconds) when it was written, just after the call's replies: the call ran
    from end_s - total_ms. Opt-in (model parameter timing_log): a line is ~270 bytes a step."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", buffering=1)

    def timing(self, t: CallTiming) -> None:
        self._file.write(json.dumps({**t.to_json(), "end_s": round(time.time(), 4)}) + "\n")

    def close(self) -> None:
        self._file.close()


class BatcherStats(Observer):
    """Counters kept by the batcher itself."""

    def __init__(self):
        self.calls = {"decode": 0, "prefill": 0, "verify": 0, "mixed": 0}
        self.rows = {"decode": 0, "prefill": 0, "verify": 0, "mixed": 0}
        self.tokens = {"decode": 0, "prefill": 0, "verify": 0, "mixed": 0}
        self.refusals: dict[str, int] = {}
        self.pages_reclaimed = 0
        self.sequences_reclaimed = 0
        self.prefix_queried = 0  # prompt tokens looked up in the prefix cache
        self.prefix_reused = 0  # of them, found cached
        self.prefix_from_host = 0  # of them, written back from the host tier
        self.continuations = 0
        self.evicted_pages = 0
        self.dropped_sequences = 0
        self.swaps = {"out": 0, "in": 0}
        self.swap_bytes = {"out": 0, "in": 0}
        self.preemptions = 0
        self.recomputes = 0  # sequences whose KV was dropped to make room
        self.held_for_compile = {"decode": 0, "prefill": 0, "verify": 0}  # calls held back
        self.drafted = 0  # draft tokens checked by verify calls
        self.accepted = 0  # of them, accepted
        self.verify_steps = 0  # verify rows: accepted + verify_steps tokens came of them
        # NaN or inf logits (a mixed call's rows count as its decode rows' and prompt's)
        self.nonfinite_rows = {"decode": 0, "prefill": 0, "verify": 0}
        self.waits_s: deque[float] = deque(maxlen=100_000)  # arrival -> execution start
        # Tokens by part of a step, and steps by what they carried (mixed: both)
        self.step_tokens = {"prompt": 0, "decode": 0}
        self.steps = {"prompt": 0, "decode": 0, "mixed": 0}
        self.prompt_waits_s: deque[float] = deque(maxlen=100_000)  # arrival -> first chunk
        self.call_sizes: list[tuple[str, int]] = []
        # Each entry's recent call time (a moving average): what speculation weighs a verify
        # call against a decode call by.
        self.entry_seconds: dict[str, float] = {}

    def call(self, kind: str, entry: str, rows: int, tokens: int, waits_s: list[float],
             seconds: float, executions: int = 1) -> None:
        self.calls[kind] += executions
        self.rows[kind] += rows
        self.tokens[kind] += tokens
        self.waits_s.extend(waits_s)
        if len(self.call_sizes) < 100_000:
            self.call_sizes.append((kind, rows))
        if executions == 1:  # a call split while entries compile says nothing of one entry's
            old = self.entry_seconds.get(entry)
            self.entry_seconds[entry] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def step(self, prompt_tokens: int, decode_tokens: int) -> None:
        self.step_tokens["prompt"] += prompt_tokens
        self.step_tokens["decode"] += decode_tokens
        self.steps["mixed" if prompt_tokens and decode_tokens else
                   "prompt" if prompt_tokens else "decode"] += 1

    def prompt_started(self, wait_s: float) -> None:
        self.prompt_waits_s.append(wait_s)

    def call_seconds(self, entries: dict, kind: str, rows: int, tokens: int) -> float | None:
        """The recent time of a call of `kind` over `rows` rows of `tokens` tokens each: the
        mean over contexts of the smallest timed entry of `entries` (the artifact's, by name)
        that holds it; None when none is timed yet. Read from other threads: looks up, never
        iterates, the times the batching thread writes."""
        timed = [(e, t) for e in entries.values()
                 if e.kind == kind and e.batch >= rows and e.tokens_per_seq >= tokens
                 and (t := self.entry_seconds.get(e.name)) is not None]
        if not timed:
            return None
        smallest = min((e.batch, e.tokens_per_seq) for e, _ in timed)
        times = [t for e, t in timed if (e.batch, e.tokens_per_seq) == smallest]
        return sum(times) / len(times)

    def refusal(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def reclaimed(self, sequences: int, pages: int) -> None:
        self.sequences_reclaimed += sequences
        self.pages_reclaimed += pages

    def prefix(self, queried: int, reused: int, continued: bool, from_host: int = 0) -> None:
        self.prefix_queried += queried
        self.prefix_reused += reused
        self.prefix_from_host += from_host
        self.continuations += int(continued)

    def evicted(self, pages: int, sequences: int) -> None:
        self.evicted_pages += pages
        self.dropped_sequences += sequences

    def swapped(self, direction: str, nbytes: int, seconds: float) -> None:
        self.swaps[direction] += 1
        self.swap_bytes[direction] += nbytes

    def preempted(self) -> None:
        self.preemptions += 1

    def recomputed(self) -> None:
        self.recomputes += 1

    def held_back(self, kind: str) -> None:
        self.held_for_compile[kind] += 1

    def nonfinite(self, kind: str, rows: int) -> None:
        self.nonfinite_rows[kind] += rows

    def speculation(self, drafted: int, accepted: int, steps: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += steps

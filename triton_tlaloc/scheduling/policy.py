"""Which queued requests run now: the batch selection policy, as a pure function of what is
pending, the decode cohort, the policy's waits and the clock (docs/design.md#batching).

- Decode cohorts. The sequences of the previous decode batch (and those whose prompt ran since)
  form the cohort. The next decode batch runs once every cohort member still held has its next
  request queued, or at the cohort's deadline (`cohort_wait_s` after the previous batch). A
  lone sequence is its own cohort and never waits; sequences decoding together stay together
  whatever the spread of their clients' replies. With `cohort_wait_steps` (off by default) the
  deadline is also at most that many of the previous batch's call times: when the replies of a
  large batch take longer to reach their clients than a step, the calls keep running on
  whoever is back, at the price of splitting cohorts whose clients pause.
- Merged prompts. A prompt waits up to `prefill_wait_s` for prompts sent with it, or runs at
  once when they fill the largest prefill batch. A later request of several tokens is a prefill
  continuation and waits like a prompt.
- One request per sequence per round, in arrival order: a sequence's later requests stay queued.
- Prompt scoring takes its share. A chunk of a prompt whose log-probabilities are asked for (a
  verify call of several tokens, `Request.scoring`) runs at once in a round with nothing else
  to run; beside other sequences' work it runs once the rounds it sat out since it was queued
  took as long as its own call takes (`chunk_seconds`, the recent time of such a call), and
  twice that in a round with a prompt in it: the other sequences get at least half the time,
  a new chat's prompt does not wait behind a chunk, and the scoring still goes on.
- With `backend_batching` off, each execute() call's requests run as one round, as Triton formed
  them (the control for Triton's own batching).

No Triton, no JAX, no thread: `select` is called by the batcher's thread with its lock held, and
by the tests with a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container, Iterable, Protocol

from ..model_parameters import (MAX_SEQUENCE_IDLE_MICROSECONDS, default_bool, default_float,
                                default_int)


@dataclass(frozen=True)
class BatchPolicy:
    """The batcher's timing, by default the model parameters' defaults
    (model_parameters.py)."""

    cohort_wait_s: float = default_int("cohort_wait_microseconds") / 1e6
    # > 0: the cohort wait is also at most this many of the previous decode call's durations
    # (0: off)
    cohort_wait_steps: float = default_float("cohort_wait_steps")
    prefill_wait_s: float = default_int("prefill_wait_microseconds") / 1e6
    # the most prompt tokens a step carries beside decode rows (0: the largest mixed entry's)
    mixed_chunk_tokens: int = default_int("mixed_chunk_tokens")
    backend_batching: bool = default_bool("backend_batching")
    # the model's max_sequence_idle_microseconds
    idle_timeout_s: float = MAX_SEQUENCE_IDLE_MICROSECONDS / 1e6
    # Triton checks its timeout on a schedule of its own
    reclaim_allowance_s: float = default_int("reclaim_allowance_microseconds") / 1e6

    def __post_init__(self):
        if self.cohort_wait_steps < 0:
            raise ValueError(f"cohort_wait_steps {self.cohort_wait_steps}: expected 0 (off) or "
                             f"more")
        if self.mixed_chunk_tokens < 0:
            raise ValueError(f"mixed_chunk_tokens {self.mixed_chunk_tokens}: expected 0 (the "
                             f"largest mixed entry's) or more")

    def chunk_tokens(self, most: int) -> int:
        """The prompt tokens a step carries beside decode rows, of the `most` a mixed entry
        takes (0: no mixed entry)."""
        return min(most, self.mixed_chunk_tokens) if self.mixed_chunk_tokens else most

    def cohort_wait(self, decode_s: float | None) -> float:
        """How long the next decode batch waits for its cohort, given the previous decode
        call's seconds (None: none ran yet)."""
        if self.cohort_wait_steps > 0 and decode_s is not None:
            return min(self.cohort_wait_s, self.cohort_wait_steps * decode_s)
        return self.cohort_wait_s

    @property
    def reclaim_after_s(self) -> float:
        """Idle time after which Triton has surely ended a sequence (it sends no END then)."""
        return 2 * self.idle_timeout_s + self.reclaim_allowance_s


class Queued(Protocol):
    """What the policy reads of a queued request (batcher.Request is one)."""

    seq_id: int | str
    arrived: float  # clock time it was queued
    group: int  # the execute() call it came in

    @property
    def is_prompt(self) -> bool: ...

    # (and `scoring`, read as False when absent: a chunk of a prompt's scoring)


@dataclass
class Cohort:
    """The sequences of the previous decode batch, and when the next may stop waiting for them."""

    members: set
    deadline: float = 0.0


def first_per_sequence(pending: Iterable[Queued],
                       keep: Callable[[Queued], bool] = lambda r: True) -> list[Queued]:
    """Each sequence's earliest queued request (kept if `keep` says so), in arrival order."""
    seen, out = set(), []
    for r in pending:
        if r.seq_id not in seen:
            seen.add(r.seq_id)
            if keep(r):
                out.append(r)
    return out


def select(pending: list[Queued], *, now: float, policy: BatchPolicy, cohort: Cohort,
           held: Container, max_prefill_batch: int,
           chunk_seconds: Callable[[Queued], float | None] | None = None
           ) -> tuple[list[Queued], float | None]:
    """The requests to run now, and when to look again if some wait (None: nothing waits).
    `held` holds the sequence ids the model still holds (a cohort member that ended is not
    waited for). `chunk_seconds(r)`: the recent time of a scoring request's call (None: not
    measured yet, and it runs as any step does)."""
    if not pending:
        return [], None
    if not policy.backend_batching:
        group = pending[0].group
        return first_per_sequence(pending, lambda r: r.group == group), None
    firsts = first_per_sequence(pending)
    prompts = [r for r in firsts if r.is_prompt]
    steps = [r for r in firsts if not r.is_prompt]  # decode steps, and ENDs with no tokens
    take, wake_at = [], None
    if steps:
        present = {r.seq_id for r in firsts}
        missing = [s for s in cohort.members if s in held and s not in present]
        if not missing or now >= cohort.deadline:
            take += steps
        else:
            wake_at = cohort.deadline
    prompts_taken = False
    if prompts:
        due = prompts[0].arrived + policy.prefill_wait_s
        if now >= due or len(prompts) >= max_prefill_batch:
            take += prompts
            prompts_taken = True
        else:
            wake_at = due if wake_at is None else min(wake_at, due)
    scoring = [r for r in take if getattr(r, "scoring", False)]
    if scoring and len(scoring) < len(take):
        # Others run this round: a chunk that has not sat out its share stays queued for the
        # next round
        def owed(r) -> float:
            cost = (chunk_seconds(r) if chunk_seconds is not None else None) or 0.0
            return (2 if prompts_taken else 1) * cost
        left = {id(r) for r in scoring if now - r.arrived < owed(r)}
        take = [r for r in take if id(r) not in left]
    return take, wake_at


def choose_reclaim(candidates: list[tuple[object, object, float]], need, now: float,
                   idle_limit: float) -> list[object]:
    """Which sequences to reclaim so that `need` more pages are free.

    candidates: (sequence id, pages held, last activity time); need: pages wanted. Pages are an
    int, or a dict by pool ({"full": 3, "windowed": 1, "state": 1}) when a model has a windowed
    pool or state slots. Only
    sequences idle longer than `idle_limit` qualify: Triton has ended them (it sends no END for
    a sequence it times out), so no client can continue them. Least recently active first, and
    only as many as `need`. When the qualifying sequences cannot free `need` pages, nothing is
    reclaimed: the request is refused and no sequence loses its KV for nothing.
    """
    def as_dict(pages):
        return pages if isinstance(pages, dict) else {"full": pages}

    need = {k: v for k, v in as_dict(need).items() if v > 0}
    idle = sorted((c for c in candidates if now - c[2] > idle_limit
                   and any(as_dict(c[1]).values())), key=lambda c: c[2])
    chosen, freed = [], dict.fromkeys(need, 0)

    def covered():
        return all(freed[k] >= v for k, v in need.items())

    for seq_id, pages, _ in idle:
        if covered():
            break
        chosen.append(seq_id)
        for k in freed:
            freed[k] += as_dict(pages).get(k, 0)
    return chosen if covered() else []


def choose_swap_out(candidates: list[tuple[object, dict]], short: dict[str, int]) -> object:
    """The next sequence to swap out to the host so that `short` more pages (per pool) can be
    had, or None.

    candidates: (sequence, what swapping it out frees per pool), in the order they go: idle
    sequences, longest idle first, then those with a request waiting, most recently admitted
    first (preemption, as vLLM does). The first that frees any of what is short, when those
    that do can cover it all taken in order; None when they cannot, so that no sequence is
    swapped out for nothing (the request waits or is refused instead).
    """
    freed = dict.fromkeys(short, 0)
    first = None
    for item, frees in candidates:
        if not any(frees.get(k, 0) for k in short):
            continue
        first = item if first is None else first
        for k in freed:
            freed[k] += frees.get(k, 0)
        if all(freed[k] >= n for k, n in short.items()):
            return first
    return None

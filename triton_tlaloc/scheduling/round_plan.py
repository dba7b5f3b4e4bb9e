"""A round's plan: what the batcher runs in one round, decided before anything runs (vLLM's
SchedulerOutput). `Batcher.schedule` admits the round's requests (pages reserved, sequences
swapped, preempted or dropped to make room: `moves`) and groups the jobs into calls; `Batcher
.execute` runs the plan. The tests assert on plans. Pure Python.

Grouping: decode rows of several sequences go into one call of up to the largest decode batch;
verify rows and prompts of one context bucket into one call (a call computes every row at its
entry's context, so buckets are not merged); a prompt longer than the largest prefill entry
runs alone, in chunks. With mixed entries, a round with decode rows carries one prompt's next
chunk in its first decode call (`mixed_calls`) and the round's other prompts wait for the next
steps: no prompt's call stalls the streams (docs/design.md#mixed-steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .admission import Job


@dataclass
class MixedCall:
    """Decode rows and the next `tokens` tokens of one prompt (`chunk`), in one call."""

    decode: list[Job]
    chunk: Job
    tokens: int


@dataclass
class RoundPlan:
    mixed: list[MixedCall] = field(default_factory=list)  # run first: they carry decode rows
    decode: list[list[Job]] = field(default_factory=list)  # decode calls, in order
    verify: list[list[Job]] = field(default_factory=list)  # verify calls
    prefill: list[list[Job]] = field(default_factory=list)  # prefill calls (chunked: alone)
    # Decode steps whose entry is still compiling: (job, entry), held back, not run
    held_back: list[tuple[Job, str]] = field(default_factory=list)
    # What room making did while admitting: (what, sequence id), what one of "swapped out",
    # "swapped in", "preempted", "dropped"
    moves: list[tuple[str, object]] = field(default_factory=list)
    admit_seconds: float = 0.0  # admitting the round's requests (charged to its first call)
    # Prompts admitted and not run this round (a mixed step carries one prompt's chunk): they
    # go on in the next round's step
    deferred: list[Job] = field(default_factory=list)

    def calls(self) -> list[tuple[str, list[Job]]]:
        """(kind, rows) of every call, in the order they run."""
        return ([("mixed", [*m.decode, m.chunk]) for m in self.mixed]
                + [("decode", g) for g in self.decode] + [("verify", g) for g in self.verify]
                + [("prefill", g) for g in self.prefill])

    def rows(self, kind: str) -> list[list[object]]:
        """The sequence ids of each call of `kind` (what the tests compare)."""
        return [[j.seq.seq_id for j in g] for k, g in self.calls() if k == kind]


def mixed_calls(decode: list[Job], prompts: list[Job], max_batch: int, max_tokens: int
                ) -> tuple[list[MixedCall], list[Job], list[Job]]:
    """One token budget per step: with decode rows in the round, the first `max_batch` of
    them and the next chunk of the first prompt (a prompt under way before new ones), up to
    `max_tokens` tokens, as one mixed call. Returns (the mixed calls, the decode rows left for
    decode calls, the prompts deferred to the next round). No decode row, no prompt or no
    mixed entry (`max_tokens` 0): nothing is mixed or deferred."""
    if not decode or not prompts or max_tokens <= 0:
        return [], decode, []
    chunk = prompts[0]
    tokens = min(len(chunk.seq.uncached), max_tokens)
    return [MixedCall(decode[:max_batch], chunk, tokens)], decode[max_batch:], prompts[1:]


# What a second call costs beyond its tokens, in prompt tokens: a mixed call beside 16 streams
# cost about 55 ms + 3.2 ms a chunk token past the streams' own step (SmolLM2 f32 on 2 cores,
# chunks of 32 to 192; scripts/mixed_step_bench.py)
CALL_TOKENS = 16


def fitted_chunk(left: int, most: int, sizes: list[int], call_tokens: int | None = None) -> int:
    """The next chunk of a prompt with `left` tokens to run, at most `most`, for mixed entries
    of chunks of `sizes` tokens (a chunk runs padded to the smallest that holds it): the rest
    whole, unless a chunk that fills an entry and then the rest pad fewer tokens by more than
    a second call costs (`call_tokens`); past `most`, the largest entry it fills. A 100-token
    prompt beside 16 streams with entries of 64 and 192: 64 then 36 took 863 ms for two of
    the streams' steps, one call of 192 928 ms for one."""
    fits = sorted(t for t in sizes if t <= most)
    if not fits or left <= fits[0]:
        return min(left, most)

    def padding(n: int) -> int:  # of n tokens in the smallest entry that holds them
        return min((t for t in sizes if t >= n), default=n) - n

    fill = max(t for t in fits if t <= left)
    if left > most:
        return fill
    call = CALL_TOKENS if call_tokens is None else call_tokens
    return fill if padding(left - fill) + call < padding(left) else left


def decode_calls(jobs: list[Job], max_batch: int) -> list[list[Job]]:
    """Decode rows in calls of up to `max_batch` (a decode entry holds any context bucket up
    to its own: the smallest entry that holds the call is chosen when it runs)."""
    return [jobs[i:i + max_batch] for i in range(0, len(jobs), max_batch)]


def bucket_calls(jobs: list[Job], max_batch: int, context_ladder: list[int]) -> list[list[Job]]:
    """Jobs of one context bucket as one call of up to `max_batch` rows, smallest bucket first."""
    by_bucket: dict[int, list[Job]] = {}
    for job in jobs:
        end = len(job.seq.token_ids)
        bucket = next(c for c in context_ladder if c >= end)
        by_bucket.setdefault(bucket, []).append(job)
    calls = []
    for bucket in sorted(by_bucket):
        js = by_bucket[bucket]
        calls += [js[i:i + max_batch] for i in range(0, len(js), max_batch)]
    return calls


def prefill_calls(jobs: list[Job], max_batch: int, context_ladder: list[int],
                  max_call_tokens: Callable) -> list[list[Job]]:
    """Prompts by context bucket (`bucket_calls`); one longer than `max_call_tokens(seq)`, the
    most one prefill call may feed it, alone (in chunks), after them."""
    fits, alone = [], []
    for job in jobs:
        n = len(job.seq.token_ids) - job.seq.num_cached
        (alone if n > max_call_tokens(job.seq) else fits).append(job)
    return bucket_calls(fits, max_batch, context_ladder) + [[job] for job in alone]


def forced_rows_to_decode(requests: list, call_seconds: Callable[[str, int, int], float | None]
                          ) -> list:
    """The verify requests of a round that carry a grammar's forced tokens alone and run
    better as rows of the round's decode call, their forced tokens then fed one a step (the
    ids are the same). A verify call beside the decode call delays every row of it: the rows
    join when the decode call with them yields at least the tokens a second of the two calls.
    None join when the round has no decode row, when a row carries speculation's drafts or a
    chunk of a prompt's scoring (its verify call runs anyway: a scoring row fed one token a
    round would take a call per prompt token) or when a call's time is not measured yet.
    `call_seconds(kind, rows, tokens)`: a call's recent time."""
    decode = sum(1 for r in requests if r.is_decode)
    verify = [r for r in requests if r.is_verify]
    if not decode or not verify or any(r.forced_tokens < r.draft_tokens or r.scoring
                                       for r in verify):
        return []
    apart = (call_seconds("decode", decode, 1),
             call_seconds("verify", len(verify), 1 + max(r.draft_tokens for r in verify)))
    joined = call_seconds("decode", decode + len(verify), 1)
    if None in apart or joined is None:
        return []
    tokens_apart = decode + sum(1 + r.draft_tokens for r in verify)
    if (decode + len(verify)) / joined >= tokens_apart / sum(apart):
        return verify
    return []

"""The batcher without a server: calls formed, refusals that change nothing, one reply each."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triton_tlaloc.batcher import (INTERNAL, INVALID_ARG, UNAVAILABLE, Batcher, Reply, Request)
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.scheduling.policy import BatchPolicy

PROMPTS = {"a": [1, 17, 99, 3, 200], "b": [1, 64, 9], "c": [5, 6, 7, 8, 9, 10, 11], "d": [4, 4]}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def runtime(tiny):
    return Runtime(tiny.artifact("llama", False))


# No waiting: these tests are about what a round does, not when it runs (test_policy.py).
NO_WAIT = BatchPolicy(cohort_wait_s=0.0, prefill_wait_s=0.0)


@pytest.fixture
def batcher(runtime):
    # A fresh engine (page pool) per test over the one compiled runtime.
    return Batcher(Engine(runtime, prefix_reuse=True), NO_WAIT, clock=Clock())


class Collector:
    def __init__(self):
        self.replies: dict = {}

    def request(self, seq_id, tokens, start=False, end=False) -> Request:
        def reply_fn(reply: Reply, key=seq_id):
            self.replies.setdefault(key, []).append(reply)
        return Request(seq_id, list(tokens), start, end, reply_fn)

    def last(self, seq_id) -> Reply:
        return self.replies[seq_id][-1]

    def last_logits(self, seq_id) -> np.ndarray:
        return next(r.logits for r in reversed(self.replies[seq_id]) if r.logits is not None)


def solo_ids(runtime, prompt, steps):
    return Engine(runtime).generate_greedy(prompt, steps).generated_ids


def step_all(batcher, col, seqs, steps):
    """Greedy decode of several sequences through the batcher, all stepping together."""
    ids = {s: [] for s in seqs}
    for _ in range(steps):
        for s in seqs:
            t = int(np.argmax(col.last_logits(s)))
            ids[s].append(t)
            batcher.submit(col.request(s, [t]))
        batcher.run_pending()
    return ids


def test_sequences_waiting_together_run_as_one_call_and_equal_their_solo_runs(batcher, runtime):
    col = Collector()
    for s in ("a", "b"):
        batcher.submit(col.request(s, PROMPTS[s], start=True))
    batcher.run_pending()
    assert batcher.stats.calls == {"decode": 0, "prefill": 1, "verify": 0, "mixed": 0}, \
        "two prompts of one bucket merged"
    ids = step_all(batcher, col, ["a", "b"], 5)
    assert batcher.stats.calls["decode"] == 5 and batcher.stats.rows["decode"] == 10
    for s in ("a", "b"):
        t = int(np.argmax(col.last_logits(s)))
        assert ids[s] + [t] == solo_ids(runtime, PROMPTS[s], 6)
    for s in ("a", "b"):
        assert all(r.error is None for r in col.replies[s])
        assert len(col.replies[s]) == 6, "one reply per request"


def test_prompts_of_different_buckets_are_not_merged(batcher):
    col = Collector()
    batcher.submit(col.request("short", [3, 4], start=True))
    batcher.submit(col.request("long", list(range(3, 3 + 40)), start=True))  # bucket 128
    batcher.run_pending()
    assert batcher.stats.calls["prefill"] == 2


def test_a_sequences_later_request_waits_for_the_next_round(batcher, runtime):
    col = Collector()
    batcher.submit(col.request("a", PROMPTS["a"], start=True))
    batcher.submit(col.request("a", [42]))
    batcher.run_pending()
    assert len(col.replies["a"]) == 1
    batcher.run_pending()
    assert len(col.replies["a"]) == 2 and col.last("a").error is None


@pytest.mark.parametrize("tokens,message", [
    ([5, 256], "token id 256 is outside the vocabulary [0, 256)"),
    ([-1], "token id -1 is outside the vocabulary"),
    ([], "TOKENS is empty"),
    (list(range(3, 3 + 130)), "positions would exceed the largest context 128"),
])
def test_refusals_name_the_problem_and_leave_the_sequence_as_it_was(batcher, runtime, tokens,
                                                                    message):
    col = Collector()
    batcher.submit(col.request("a", PROMPTS["a"], start=True))
    batcher.run_pending()
    seq = batcher.sequences["a"]
    state = (list(seq.token_ids), seq.num_cached, list(seq.pages), batcher.engine.blocks.full.free)
    batcher.submit(col.request("a", tokens))
    batcher.run_pending()
    reply = col.last("a")
    assert reply.code == INVALID_ARG and message in reply.error and "sequence a" in reply.error
    assert (list(seq.token_ids), seq.num_cached, list(seq.pages),
            batcher.engine.blocks.full.free) == state
    # the sequence continues with its solo ids
    ids = step_all(batcher, col, ["a"], 4)["a"]
    assert ids == solo_ids(runtime, PROMPTS["a"], 4)


def test_a_prompt_longer_than_the_largest_context_is_refused(batcher):
    col = Collector()
    free = batcher.engine.blocks.full.free
    batcher.submit(col.request("x", list(range(3, 3 + 129)), start=True))
    batcher.run_pending()
    assert col.last("x").code == INVALID_ARG and "largest context 128" in col.last("x").error
    assert "x" not in batcher.sequences and batcher.engine.blocks.full.free == free


def test_unknown_sequence_without_start_is_refused(batcher):
    col = Collector()
    batcher.submit(col.request("ghost", [5]))
    batcher.run_pending()
    assert col.last("ghost").code == INVALID_ARG
    assert "sequence ghost is not held" in col.last("ghost").error


def test_full_pool_refused_with_the_holders_then_the_same_request_succeeds(runtime):
    engine = Engine(runtime, prefix_reuse=True)
    batcher = Batcher(engine, NO_WAIT, clock=Clock())
    col = Collector()
    # 32 usable pages of 8 tokens: four 64-token prompts (8 pages each) fill the pool.
    assert engine.blocks.full.free == 32
    for i, s in enumerate(("p", "q", "r", "s")):  # prompts sharing no block
        batcher.submit(col.request(s, list(range(10 + i, 74 + i)), start=True))
        batcher.run_pending()
    assert engine.blocks.full.free == 0
    batcher.submit(col.request("p", [5]))  # position 64 needs a ninth page
    batcher.run_pending()
    reply = col.last("p")
    assert reply.code == UNAVAILABLE
    assert "KV pool full" in reply.error
    assert "4 sequences hold pages" in reply.error
    assert len(batcher.sequences["p"].token_ids) == 64 and batcher.sequences["q"].pages
    batcher.submit(col.request("q", [], end=True))  # q ends: its pages are kept, evictable
    batcher.run_pending()
    assert batcher.pool_state()["full"] == (24, 8, 0)
    batcher.submit(col.request("p", [5]))
    batcher.run_pending()
    assert col.last("p").error is None and len(batcher.sequences["p"].pages) == 9


def test_a_second_start_on_a_held_id_never_continues_the_old_kv(batcher, runtime):
    col = Collector()
    batcher.submit(col.request("a", PROMPTS["a"], start=True))
    batcher.run_pending()
    batcher.submit(col.request("a", list(range(3, 3 + 130)), start=True))  # refused
    batcher.run_pending()
    assert col.last("a").code == INVALID_ARG
    assert "a" not in batcher.sequences, "the old sequence is gone, not left to be continued"
    batcher.submit(col.request("a", [5]))
    batcher.run_pending()
    assert "not held" in col.last("a").error


def test_a_failed_call_answers_each_request_once_and_rolls_back(batcher, monkeypatch):
    col = Collector()
    batcher.submit(col.request("a", PROMPTS["a"], start=True))
    batcher.run_pending()
    seq = batcher.sequences["a"]
    state = (list(seq.token_ids), seq.num_cached, list(seq.pages))

    def boom(seqs):
        raise RuntimeError("device lost")
    monkeypatch.setattr(batcher.engine, "decode", boom)
    batcher.submit(col.request("a", [9]))
    batcher.run_pending()
    assert col.last("a").code == INTERNAL and "device lost" in col.last("a").error
    assert (list(seq.token_ids), seq.num_cached, list(seq.pages)) == state
    assert len(col.replies["a"]) == 2


def test_the_thread_answers_every_request(runtime):
    import threading

    batcher = Batcher(Engine(runtime, prefix_reuse=True))  # the real clock and the default waits
    batcher.start()
    done = threading.Event()
    got = []

    def reply_fn(reply):
        got.append(reply)
        done.set()
    batcher.submit(Request("t", [1, 2, 3], True, True, reply_fn))
    assert done.wait(30)
    batcher.stop()
    assert len(got) == 1 and got[0].error is None and got[0].logits.shape == (256,)
    assert "t" not in batcher.sequences and batcher.pool_state()["full"][0] == 0


def test_a_later_request_with_several_tokens_is_a_prefill_continuation(batcher, runtime):
    """Tokens sent after the prompt in one request equal the same tokens sent one by one."""
    col = Collector()
    extra = [88, 150, 12, 5]
    batcher.submit(col.request("a", PROMPTS["a"], start=True))
    batcher.submit(col.request("b", PROMPTS["a"], start=True))
    batcher.run_pending()
    batcher.submit(col.request("a", extra))
    batcher.run_pending()
    assert batcher.stats.calls["prefill"] == 2, "the continuation ran as a prefill call"
    for t in extra:
        batcher.submit(col.request("b", [t]))
        batcher.run_pending()
    a, b = col.last_logits("a"), col.last_logits("b")
    assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, np.max(np.abs(b)))
    assert len(batcher.sequences["a"].token_ids) == len(PROMPTS["a"]) + len(extra)


def test_timing_log_accounts_for_each_call(runtime, tmp_path):
    """The step profile's source: one CallTiming per call, its phases adding up to its total,
    the executable's time taken from the runtime, and one JSON line each in the timing log."""
    from triton_tlaloc.scheduling.observer import CallTiming, Observer, TimingLog

    class Keep(Observer):
        def __init__(self):
            self.timings: list[CallTiming] = []

        def timing(self, t):
            self.timings.append(t)

    keep, path = Keep(), tmp_path / "timing.jsonl"
    log = TimingLog(str(path))
    batcher = Batcher(Engine(runtime, prefix_reuse=True), NO_WAIT, clock=Clock(),
                      observers=(keep, log))
    col = Collector()
    execute_before = runtime.phase_seconds["execute"]
    batcher.submit_group([col.request("a", PROMPTS["a"], start=True),
                          col.request("b", PROMPTS["b"], start=True)])
    assert batcher.run_pending()
    batcher.submit_group([col.request("a", [5]), col.request("b", [6])])
    assert batcher.run_pending()
    log.close()
    assert [(t.kind, t.rows) for t in keep.timings] == [("prefill", 2), ("decode", 2)]
    for t in keep.timings:
        parts = [getattr(t, p) for p in CallTiming.PHASES]
        assert min(parts[1:]) >= 0.0 and t.execute > 0.0, t
        assert abs(sum(parts[1:]) - t.total) < 1e-6, t  # wait is before the round
    assert abs(sum(t.execute for t in keep.timings)
               - (runtime.phase_seconds["execute"] - execute_before)) < 1e-9
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["kind"], x["entry"]) for x in lines] == [(t.kind, t.entry) for t in keep.timings]
    assert lines[1]["entry"] == "decode_b2_c32" and lines[1]["execute_ms"] > 0
    # each line's wall clock, written after its call: in order, each call after the one before
    assert lines[0]["end_s"] - lines[0]["total_ms"] / 1e3 <= lines[0]["end_s"] <= lines[1]["end_s"]
    assert lines[1]["end_s"] - lines[1]["total_ms"] / 1e3 >= lines[0]["end_s"] - 1e-3

"""The benchmark mode `simulate_step_ms` (runtime/simulated.py): refused outside a benchmark, and
over it the engine and the batcher run as served, batched rows getting the ids they get alone."""

from __future__ import annotations

import time

import numpy as np
import pytest
from checks.fakes import Clock, fake_artifact

from triton_tlaloc.batcher import Batcher, Request
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.scheduling.policy import BatchPolicy
from triton_tlaloc.runtime.simulated import BENCHMARK_ENV, SimulatedRuntime, simulated_step_s

ART = fake_artifact(batch_ladder=(1, 2, 4, 8, 16, 32, 64), context_ladder=(32,),
                    prefill_tokens=())


def test_the_mode_is_refused_unless_the_environment_says_benchmark(monkeypatch):
    monkeypatch.delenv(BENCHMARK_ENV, raising=False)
    assert simulated_step_s("") is None
    with pytest.raises(ValueError, match=f"benchmark mode: set {BENCHMARK_ENV}=1"):
        simulated_step_s("10")
    monkeypatch.setenv(BENCHMARK_ENV, "1")
    assert simulated_step_s("10") == pytest.approx(0.010)
    for bad in ("ten", "-1", "nan"):
        with pytest.raises(ValueError, match="simulate_step_ms"):
            simulated_step_s(bad)


def greedy_rounds(batcher: Batcher, prompts: list[list[int]], steps: int) -> dict:
    """Every sequence's ids, the prompts sent together and each step's requests together."""
    replies: dict = {}

    def sender(i):
        return lambda reply: replies.setdefault(i, []).append(reply)

    for i, p in enumerate(prompts):
        batcher.submit(Request(i, p, True, False, sender(i)))
    for step in range(steps + 1):
        batcher.clock.advance(1.0)
        while batcher.run_pending():
            pass
        if step < steps:
            for i in range(len(prompts)):
                token = int(np.argmax(replies[i][-1].logits))
                batcher.submit(Request(i, [token], False, step == steps - 1, sender(i)))
    assert all(r.error is None for rs in replies.values() for r in rs)
    return {i: [int(np.argmax(r.logits)) for r in rs] for i, rs in replies.items()}


def batcher_over(rt) -> Batcher:
    return Batcher(Engine(rt), BatchPolicy(prefill_wait_s=0.0, cohort_wait_s=0.0), clock=Clock())


def test_64_sequences_batched_get_the_ids_they_get_alone_and_every_call_waits_its_step():
    prompts = [[(i * 7 + j) % 250 + 3 for j in range(4)] for i in range(64)]
    rt = SimulatedRuntime(ART, 0.002)
    t0 = time.perf_counter()
    together = greedy_rounds(batcher_over(rt), prompts, steps=8)
    assert time.perf_counter() - t0 >= rt.runs * 0.002
    assert rt.runs <= 9 * 2  # 64 rows a call: one prefill and one decode call per step
    alone = {i: greedy_rounds(batcher_over(SimulatedRuntime(ART, 0.0)), [p], 8)[0]
             for i, p in enumerate(prompts[:8])}
    assert {i: together[i] for i in alone} == alone
    assert len({tuple(ids) for ids in together.values()}) > 32  # rows are told apart


def test_the_check_sees_a_row_answered_with_another_rows_logits():
    """Negative control: logits rolled by one row across the batch are caught."""
    prompts = [[(i * 7 + j) % 250 + 3 for j in range(4)] for i in range(8)]
    rt = SimulatedRuntime(ART, 0.0)
    run = rt.run
    rt.run = lambda name, step: np.roll(run(name, step), 1, axis=0)
    together = greedy_rounds(batcher_over(rt), prompts, steps=4)
    alone = greedy_rounds(batcher_over(SimulatedRuntime(ART, 0.0)), prompts[:1], 4)[0]
    assert together[0] != alone

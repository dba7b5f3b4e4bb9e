"""64 sequences at once through tritonserver: the tiny llama exported with a batch ladder up to
64, its replies sent by the reply threads. Every sequence's greedy ids equal its solo run, and
the decode calls really held many rows (a batch of 64 prompts runs as decode calls of more than
32 rows), so the check cannot pass on small batches alone. The same for 64 streams of its
generate model, whose loops run in the sequence model's process. And four clients that pause
between steps stay one cohort under the server's defaults (a cohort wait bounded by the step,
the control, splits them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from checks.sequence_checks import (assert_check, check_concurrent_solo, metrics_delta,
                                    paused_sequences, solo_runs)

from triton_tlaloc.frontends.client import generate
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

SEQUENCES, STEPS = 64, 8
GENERATE_STEPS = 24  # a prompt of up to 7 and 24 tokens: within the context of 32


def test_64_sequences_batched_equal_their_solo_runs(tiny, work):
    art = tiny.artifact("llama", False, batch_ladder=(1, 8, 64), context_ladder=(32,),
                        num_blocks=SEQUENCES * 32 // 8 + 1)
    repo = work / "repo-many"
    # The server's defaults: a cohort waits for its members up to the cohort wait (20 ms), so
    # 64 clients' requests meet in one call though the tiny model's step is ~1 ms. The control
    # bounds the wait by one step.
    write_repository(art, repo, "many", RepositoryOptions())
    write_repository(art, repo, "many_split", RepositoryOptions(cohort_wait_steps=1))
    prompts = [[(i * 37 + 5 * j) % 250 + 3 for j in range(3 + i % 5)] for i in range(SEQUENCES)]
    # Every entry compiled first: the calls counted below are those of a steady server (the
    # first requests' window is tests/test_ready_early.py's)
    with TritonServer(repo) as server:
        assert 'reply_threads' in (repo / "many" / "config.pbtxt").read_text()
        solo = solo_runs(server.grpc_url, "grpc", "many", prompts, STEPS)
        result, delta = metrics_delta(server.metrics_url, lambda: check_concurrent_solo(
            server.grpc_url, "grpc", "many", prompts, STEPS, solo=solo))
        assert_check(result)
        calls = delta("tlaloc_batch_size_count", model="many")
        rows = delta("tlaloc_batch_size_sum", model="many")
        large = calls - delta("tlaloc_batch_size_bucket", model="many", le="32")
        print(f"{calls:.0f} calls for {SEQUENCES} sequences of {STEPS} steps, {rows / calls:.1f} "
              f"rows a call, {large:.0f} of more than 32 rows")
        # Alone each sequence is a row a call. On an idle machine every step was one
        # call of 64 rows; under CI's load the clients' requests arrive spread out, and one run
        # had 28 calls, 3 of them over 32 rows: the bounds hold for both and fail for one row a
        # call or calls of 8 rows at most.
        assert large >= 1, "no call held more than 32 rows"
        assert rows / calls >= 8, f"{rows / calls:.1f} rows a call"

        # 64 generate streams at once (longer than the sequences above, so that they overlap
        # though each client starts on its own): the local loops decode in shared calls too.
        solo = solo_runs(server.grpc_url, "grpc", "many", prompts, GENERATE_STEPS)

        def stream(prompt):
            return generate(server.grpc_url, "many_generate", input_ids=prompt,
                            sampling={"max_tokens": GENERATE_STEPS, "ignore_eos": True})
        results = []
        _, delta = metrics_delta(server.metrics_url, lambda: results.extend(
            ThreadPoolExecutor(SEQUENCES).map(stream, prompts)))
        wrong = [i for i, (r, want) in enumerate(zip(results, solo))
                 if r.error is not None or r.token_ids != want]
        assert not wrong, f"streams {wrong[:8]} differ from their solo runs"
        calls = delta("tlaloc_batch_size_count", model="many")
        rows = delta("tlaloc_batch_size_sum", model="many")
        print(f"generate model: {calls:.0f} calls, {rows / calls:.1f} rows a call")
        # Alone a stream is 1 row a call. Shared calls measured 5.5 and 29 rows a call on an
        # idle 2-core machine, 2.7 and 1.96 in loaded CI runs (the streams start on their own
        # threads, each with its own channel, so how many overlap depends on the load): 1.5 is
        # the bound that tells them apart.
        assert rows / calls >= 1.5, "the streams decoded in shared calls (alone: 1 row a call)"

        # Four clients pausing 0-5 ms before each of 15 steps: one call a step (15, and up to
        # three more on a loaded machine: 17 in one CI run), each sequence its solo ids.
        # Bounded by the step, the control's cohort splits (verify.sh saw 37 and 47 calls with
        # that bound as the default).
        for model in ("many", "many_split"):
            solo_runs(server.grpc_url, "grpc", model, [[3, 4]], 2)  # warm: its entries compiled
        calls, same = paused_sequences(server.metrics_url, server.grpc_url, "grpc", "many")
        split, _ = paused_sequences(server.metrics_url, server.grpc_url, "grpc", "many_split")
        print(f"4 pausing clients, 60 steps: {calls} decode calls; bounded by the step: {split}")
        assert same and calls <= 18, f"{calls} decode calls for 15 steps of 4 sequences"
        assert split > 20, f"the control's cohort did not split ({split} calls)"

"""64 sequences at once through tritonserver: the tiny llama exported with a batch ladder up to
64, its replies sent by the reply threads. Every sequence's greedy ids equal its solo run, and
the decode calls really held many rows (a batch of 64 prompts runs as decode calls of more than
32 rows), so the check cannot pass on small batches alone."""

from __future__ import annotations

from sequence_checks import assert_check, check_concurrent_solo, metrics_delta, solo_runs

from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.server import TritonServer

SEQUENCES, STEPS = 64, 8


def test_64_sequences_batched_equal_their_solo_runs(tiny, work):
    art = tiny.artifact("llama", False, batch_ladder=(1, 8, 64), context_ladder=(32,),
                        num_blocks=SEQUENCES * 32 // 8 + 1)
    repo = work / "repo-many"
    # The tiny model's step is ~1 ms: cohorts bounded by the cohort wait alone (20 ms), so that
    # 64 clients' requests meet in one call.
    write_repository(art, repo, "many", RepositoryOptions(generate_model=False,
                                                          cohort_wait_steps=0))
    prompts = [[(i * 37 + 5 * j) % 250 + 3 for j in range(3 + i % 5)] for i in range(SEQUENCES)]
    with TritonServer(repo) as server:
        assert 'reply_threads' in (repo / "many" / "config.pbtxt").read_text()
        solo = solo_runs(server.grpc_url, "grpc", "many", prompts, STEPS)
        result, delta = metrics_delta(server.metrics_url, lambda: check_concurrent_solo(
            server.grpc_url, "grpc", "many", prompts, STEPS, solo=solo))
        assert_check(result)
        calls = delta("tlaloc_batch_size_count", model="many")
        large = calls - delta("tlaloc_batch_size_bucket", model="many", le="32")
        print(f"{calls:.0f} calls for {SEQUENCES} sequences of {STEPS} steps, {large:.0f} of "
              f"more than 32 rows")
        assert large >= STEPS // 2, "the sequences ran in calls of more than 32 rows"

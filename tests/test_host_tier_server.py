"""The host tier through a real tritonserver (the tiny llama, a pool for 4 sequences at its
largest context): 16 chat sessions idle between turns swap instead of being refused, with
their solo ids (the control with host_kv_bytes 0 refuses); 6 sequences outgrowing the pool
are preempted and finish with their solo ids; after a soak of sessions that end, vanish or
vanish swapped out, nothing is held; a system prompt evicted from the device is written back
from the host. The checks are checks/swap_checks.py's, which
scripts/verify.py tabulates too (there with SmolLM2)."""

from __future__ import annotations

import pytest

from checks import swap_checks as W
from checks.sequence_checks import assert_check, url_of

from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

POOL = dict(batch_ladder=(1, 2, 4), context_ladder=(32, 64), num_blocks=4 * 64 // 8 + 1)
SOAK_IDLE_US, SOAK_ALLOWANCE_US = 2_000_000, 1_000_000


@pytest.fixture(scope="module")
def served(tiny, work):
    repo = work / "repo-host-tier"
    art = tiny.artifact("llama", False, **POOL)
    wait = dict(generate_model=False, preempt_wait_microseconds=120_000_000)
    write_repository(art, repo, "swap", RepositoryOptions(**wait))
    write_repository(art, repo, "swap_control", RepositoryOptions(generate_model=False,
                                                                  host_kv_bytes=0))
    write_repository(art, repo, "swap_soak", RepositoryOptions(
        **wait, max_sequence_idle_microseconds=SOAK_IDLE_US,
        reclaim_allowance_microseconds=SOAK_ALLOWANCE_US))
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_idle_chat_sessions_are_swapped_out_instead_of_refused(served, protocol):
    results = dict(W.check_chat_pressure(url_of(served, protocol), protocol, served.metrics_url,
                                         "swap", "swap_control", seed=len(protocol)))
    assert_check(results["swapped"])
    assert_check(results["control"])


def test_sequences_outgrowing_the_pool_are_preempted_not_refused(served):
    assert_check(W.check_preemption(url_of(served, "grpc"), "grpc", served.metrics_url, "swap"))


def test_a_soak_of_ended_and_vanished_sessions_leaves_nothing_held(served):
    reclaim_after = (2 * SOAK_IDLE_US + SOAK_ALLOWANCE_US) / 1e6
    assert_check(W.check_swap_soak(url_of(served, "grpc"), "grpc", served.metrics_url,
                                   "swap_soak", seconds=8, reclaim_after_s=reclaim_after))


def test_a_prefix_evicted_from_the_device_is_written_back_from_the_host(served):
    assert_check(W.check_host_prefix(url_of(served, "grpc"), "grpc", served.metrics_url, "swap",
                                     "swap_control", fill=(4, 64)))

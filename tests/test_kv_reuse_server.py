"""KV reuse through a real tritonserver, over HTTP and gRPC: the sequence model, the generate
model and `tlaloc openai` give the same ids with prefix reuse as the same artifact served with
`--no-prefix-reuse`; cache salts share nothing; a small pool under 12 cycling users loses no
page and changes no id. The checks are checks/reuse_checks.py's, which scripts/verify.py
tabulates too."""

from __future__ import annotations

import pytest

from checks import reuse_checks as R
from checks.mixed_checks import check_prompts_join_a_stream
from checks.sequence_checks import assert_check, url_of

from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def served(tiny, smollm2, work):
    """llama and smollm2, each with reuse and cold (--no-prefix-reuse); llama with mixed
    entries; and llama with a pool for 4 sequences at its largest context (128 / 8 * 4
    pages)."""
    repo = work / "repo-reuse"
    llama = tiny.artifact("llama", False)
    small = tiny.artifact("llama", False, num_blocks=4 * 128 // 8 + 1)
    _, smol = smollm2
    for name, art in (("llama", llama), ("smollm2", smol)):
        write_repository(art, repo, name, RepositoryOptions())
        write_repository(art, repo, f"{name}_cold", RepositoryOptions(prefix_reuse=False))
    # the same weights with mixed entries (and batches to 4) and the linears' [in, out] copy
    # (which the mixed calls and prompts read), as `tlaloc export` writes them; ready once
    # every entry is compiled (`--compile-all-first`): the mixed entries compile after the
    # plain ones, and until then its calls run apart
    mixed = tiny.artifact("llama", False, batch_ladder=(1, 2, 4), mixed_tokens=(16, 64),
                          mixed_batches=(4,), in_out_copy=True)
    # The three prompts arrive together and ride the stream only if its next request comes
    # within the cohort wait; a loaded CI machine's client round trip can pass the default 20 ms.
    write_repository(mixed, repo, "llama_mixed",
                     RepositoryOptions(background_compile=False, cohort_wait_microseconds=500_000))
    # gemma3's rings (window 8, pages of 4; rings of 6 pages: chunks of 16 past the window)
    # with mixed entries, and without (the export tests/test_ready_early.py serves)
    rings = dict(context_ladder=(128,), prefill_chunk=16, block_size=4)
    write_repository(tiny.artifact("gemma3_text", True, batch_ladder=(1, 2, 4), mixed_tokens=(16,),
                                   mixed_batches=(4,), **rings), repo, "gemma3_mixed",
                     RepositoryOptions(background_compile=False, cohort_wait_microseconds=500_000))
    write_repository(tiny.artifact("gemma3_text", True, **rings), repo, "gemma3",
                     RepositoryOptions())
    write_repository(small, repo, "pressure", RepositoryOptions(generate_model=False))
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_prompts_sharing_a_prefix_reuse_it_with_the_same_ids(served, protocol):
    assert_check(R.check_shared_prefix(url_of(served, protocol), protocol, served.metrics_url,
                                       "llama", "llama_cold", seed=PROTOCOLS.index(protocol)))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_different_cache_salts_share_no_block(served, protocol):
    assert_check(R.check_cache_salts(url_of(served, protocol), protocol, served.metrics_url,
                                     "llama", seed=10 + PROTOCOLS.index(protocol)))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_salts_with_a_nul_are_refused_before_they_reach_triton(served, protocol):
    assert_check(R.check_control_character_salts(url_of(served, protocol), protocol, "llama"))
    # ... and carried whole by the CACHE_SALT input
    assert_check(R.check_binary_salts(url_of(served, protocol), protocol, served.metrics_url,
                                      "llama", seed=20 + PROTOCOLS.index(protocol)))


def test_a_chat_through_the_generate_model_continues_each_turn(served):
    assert_check(R.check_generate_chat(url_of(served, "grpc"), served.metrics_url, "llama",
                                       "llama_cold", seed=3))
    # a salt of its own: its turns continue each other, under their own root
    assert_check(R.check_generate_chat(url_of(served, "grpc"), served.metrics_url, "llama",
                                       "llama_cold", seed=3, cache_salt="tenant-c"))


def test_a_chat_through_tlaloc_openai_reuses_its_history(served):
    assert_check(R.check_openai_chat_turns(
        url_of(served, "grpc"), served.metrics_url, "smollm2", "smollm2_cold",
        ["What is the capital of France?", "And of Italy?", "Which is larger?"]))


@pytest.mark.parametrize("protocol", ["grpc"])
def test_a_small_pool_under_cycling_users_loses_nothing(served, protocol):
    import random

    url = url_of(served, protocol)
    rng = random.Random(7)
    shared = R.unique_tokens(rng, 40)
    prompts = [shared + R.unique_tokens(rng, rng.randint(3, 30)) for _ in range(6)]
    solo = R.solo_ids(url, protocol, "llama_cold", prompts, 12)
    assert_check(R.check_pressure(url, protocol, served.metrics_url, "pressure", solo, prompts,
                                  seconds=10, capacity=64))


def test_prompts_joining_a_stream_ride_its_steps_with_the_same_ids(served):
    """Mixed steps as `tlaloc serve` runs them: prompts of 20 to 90 tokens through the
    generate model (chunks of 16 and 64) arriving while a client's stream decodes ride its
    steps, and every id is the model's apart (the same weights without mixed entries or the
    [in, out] copy)."""
    assert_check(check_prompts_join_a_stream(url_of(served, "grpc"), served.metrics_url,
                                             "llama_mixed", "llama"))


def test_prompts_joining_a_stream_over_rings_ride_its_steps_with_the_same_ids(served):
    """The same with gemma3's sliding layers over rings: the chunks' and the stream's keys
    written at their ring slots, each group attending over its own rings."""
    assert_check(check_prompts_join_a_stream(url_of(served, "grpc"), served.metrics_url,
                                             "gemma3_mixed", "gemma3", seed=1))

"""A tiny qwen3_5 (Gated DeltaNet + gated attention, schema tlaloc-serving-v4) served by a real
tritonserver over HTTP and gRPC: transformers' greedy ids for a 150-token prompt, concurrent
sequences batched, a state slot refused while held, then reused after END, and prompts riding
a stream's steps in mixed calls. The checks are checks/sequence_checks.py's (which
scripts/verify.py tabulates too) and checks/mixed_checks.py's."""

from __future__ import annotations

import pytest
from checks.oracle import load_reference, reference_greedy
from test_hybrid import OPTS, PROMPT

from checks import sequence_checks as S
from checks.mixed_checks import check_prompts_join_a_stream
from checks.sequence_checks import assert_check

from triton_tlaloc.frontends.client import TlalocClient
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def served(tiny, work):
    """qwen35: the tiny hybrid model (8 state slots); qwen35_one_slot: the same with one;
    qwen35_mixed: the same weights with mixed entries, ready once every entry is compiled
    (the mixed entries compile after the plain ones, and until then its calls run apart)."""
    ckpt = tiny.checkpoint("qwen3_5_text", False)
    arts = {"qwen35": tiny.artifact("qwen3_5_text", False, **OPTS),
            "qwen35_one_slot": export_artifact(ckpt, work / "art-qwen3_5-served-one-slot",
                                               ExportOptions(**OPTS, state_slots=1))}
    repo = work / "repo-hybrid"
    for name, art in arts.items():
        # One slot: its checks are of refusals, so no host tier (it would swap instead) and
        # no generate model.
        one = name == "qwen35_one_slot"
        write_repository(art, repo, name, RepositoryOptions(
            max_sequence_idle_microseconds=600_000_000, generate_model=not one,
            host_kv_bytes=0 if one else None))
    # (few entries: a hybrid's compile takes 15-35 s each, and this one is ready only once
    # every entry is compiled: one context, prompts in chunks of 32)
    mixed = tiny.artifact("qwen3_5_text", False, **{**OPTS, "context_ladder": (128,)},
                          prefill_chunk=32, mixed_tokens=(16,))
    # The prompts arrive together and ride the stream only if its next request comes within
    # the cohort wait; a loaded CI machine's client round trip can pass the default 20 ms.
    write_repository(mixed, repo, "qwen35_mixed", RepositoryOptions(
        background_compile=False, cohort_wait_microseconds=500_000))
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    yield server, ckpt
    server.stop()


def client_for(served, protocol, model="qwen35") -> TlalocClient:
    server, _ = served
    return TlalocClient(S.url_of(server, protocol), model, protocol)


PROMPTS = {"long": PROMPT, "a": PROMPT[10:160 - 3], "b": PROMPT[60:120]}


@pytest.fixture(scope="module")
def reference(served):
    """transformers' greedy ids for the prompts these tests send."""
    model = load_reference(served[1])
    return {k: reference_greedy(model, p, 12)[0] for k, p in PROMPTS.items()}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_greedy_ids_equal_transformers(served, reference, protocol):
    with client_for(served, protocol) as client:
        assert_check(S.check_greedy_ids(client, PROMPT, reference["long"]))


def test_two_concurrent_sequences_equal_transformers(served, reference):
    """Two clients at once over gRPC: their prompts are merged into one prefill call (the shorter
    row padded) and they decode in one batch; each must give its own ids."""
    server, _ = served
    keys = ("long", "a")
    assert_check(S.check_alone_and_batched(server.grpc_url, "grpc", "qwen35",
                                           [PROMPTS[k] for k in keys],
                                           [reference[k] for k in keys], 12, alone=False))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_held_slot_is_refused_by_name_and_reused_after_end(served, reference, protocol):
    """b is refused by name while a holds the one slot; a goes on untouched; after a's END b
    takes the slot a held (never cleared) and gives transformers' ids, as a fresh server would.
    Afterwards the slot is free and the refusal counted."""
    server, _ = served
    with client_for(served, protocol, "qwen35_one_slot") as client:
        assert_check(S.check_state_slot(client, protocol, [PROMPTS["a"], PROMPTS["b"]],
                                        [reference["a"], reference["b"]]))
    assert_check(S.check_state_slot_metrics(server.metrics_url, "qwen35_one_slot"))


def test_prompts_joining_a_stream_ride_its_steps_with_the_same_ids(served):
    """Mixed steps over state slots as `tlaloc serve` runs them: prompts of 20 to 90 tokens
    through the generate model arriving while a client's stream decodes ride its steps (each
    group's conv and recurrent states at its own rows' slots), and every id is the model's
    apart (the same weights without mixed entries)."""
    server, _ = served
    assert_check(check_prompts_join_a_stream(server.grpc_url, server.metrics_url,
                                             "qwen35_mixed", "qwen35"))

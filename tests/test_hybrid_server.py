"""A tiny qwen3_5 (Gated DeltaNet + gated attention, schema tlaloc-serving-v4) served by a real
tritonserver over HTTP and gRPC: transformers' greedy ids for a 150-token prompt, concurrent
sequences batched, and a state slot refused while held, then reused after END."""

from __future__ import annotations

import re
import threading

import pytest
from oracle import load_reference, reference_greedy
from test_hybrid import OPTS, PROMPT
from test_server import greedy_continue, refused, status_of

from triton_tlaloc.frontends.client import METRICS_SETTLE_S, TlalocClient, metric, new_sequence_id, \
    scrape_metrics
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.server import TritonServer

PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def served(tiny, work):
    """qwen35: the tiny hybrid model (8 state slots); qwen35_one_slot: the same with one."""
    ckpt = tiny.checkpoint("qwen3_5_text", False)
    arts = {"qwen35": tiny.artifact("qwen3_5_text", False, **OPTS),
            "qwen35_one_slot": export_artifact(ckpt, work / "art-qwen3_5-served-one-slot",
                                               ExportOptions(**OPTS, state_slots=1))}
    repo = work / "repo-hybrid"
    for name, art in arts.items():
        write_repository(art, repo, name,
                         RepositoryOptions(max_sequence_idle_microseconds=600_000_000))
    server = TritonServer(repo, exit_timeout_s=3).start()
    yield server, ckpt
    server.stop()


def client_for(served, protocol, model="qwen35") -> TlalocClient:
    server, _ = served
    return TlalocClient(server.http_url if protocol == "http" else server.grpc_url, model,
                        protocol)


@pytest.fixture(scope="module")
def reference(served):
    """transformers' greedy ids for the prompts these tests send."""
    model = load_reference(served[1])
    prompts = {"long": PROMPT, "a": PROMPT[10:160 - 3], "b": PROMPT[60:120]}
    return {k: reference_greedy(model, p, 12)[0] for k, p in prompts.items()}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_greedy_ids_equal_transformers(served, reference, protocol):
    with client_for(served, protocol) as client:
        got = client.generate_greedy(PROMPT, 12)
    assert got.generated_ids == reference["long"]


def test_two_concurrent_sequences_equal_transformers(served, reference):
    """Two clients at once over gRPC: their prompts are merged into one prefill call (the shorter
    row padded) and they decode in one batch; each must give its own ids."""
    prompts = {"long": PROMPT, "a": PROMPT[10:160 - 3]}
    got, errors = {}, []
    barrier = threading.Barrier(2)

    def run(key):
        try:
            with client_for(served, "grpc") as client:
                barrier.wait()
                got[key] = client.generate_greedy(prompts[key], 12).generated_ids
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == {k: reference[k] for k in prompts}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_held_slot_is_refused_by_name_and_reused_after_end(served, reference, protocol):
    server, _ = served
    with client_for(served, protocol, "qwen35_one_slot") as client:
        a, b = new_sequence_id(), new_sequence_id()
        logits_a, _ = client.infer(a, PROMPT[10:160 - 3], start=True)
        err = refused(client, b, PROMPT[60:120], start=True)
        assert status_of(err, protocol) == "UNAVAILABLE", err
        assert "no free linear-attention state slot" in str(err)
        assert re.search(rf"{a} \(\d+ pages, state slot 0\)", str(err))
        assert greedy_continue(client, a, logits_a, 12) == reference["a"]  # A untouched
        client.infer(a, [], end=True)
        # B takes the slot A held (never cleared) and gives transformers' ids, as a fresh
        # server would.
        logits_b, _ = client.infer(b, PROMPT[60:120], start=True)
        assert greedy_continue(client, b, logits_b, 12) == reference["b"]
        client.infer(b, [], end=True)
    metrics = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    assert metric(metrics, "tlaloc_state_slots_used", model="qwen35_one_slot") == 0
    assert metric(metrics, "tlaloc_state_slots_free", model="qwen35_one_slot") == 1
    assert metric(metrics, "tlaloc_refusals_total", model="qwen35_one_slot",
                  reason="state_slots") >= 1

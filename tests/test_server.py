"""A real tritonserver (from the nvidia-pytriton wheel) serving tiny artifacts, over HTTP and
gRPC: transformers' greedy ids, concurrent sequences, donation, and every refusal."""

from __future__ import annotations

import json
import re
import threading

import pytest
from oracle import load_reference, reference_greedy

from triton_tlaloc.frontends.client import InferError, TlalocClient, new_sequence_id
from triton_tlaloc.engine import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.manifest import load_artifact
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.runtime import Runtime
from triton_tlaloc.server import TritonServer

PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
PROTOCOLS = ["http", "grpc"]
PLACEHOLDER = 7  # the small model's image_token_id


@pytest.fixture(scope="module")
def served(tiny, work):
    """One server for the module: llama, qwen3, llama with donate_kv_pools false, and a small
    model (a pool of 8 pages of 8 tokens, contexts 32 and 64, an image placeholder id)."""
    ckpt = tiny.checkpoint("llama", False)
    small_ckpt = work / "ckpt-small"
    if not small_ckpt.exists():
        import shutil
        shutil.copytree(ckpt, small_ckpt)
        cfg = json.loads((small_ckpt / "config.json").read_text())
        cfg["image_token_id"] = PLACEHOLDER
        (small_ckpt / "config.json").write_text(json.dumps(cfg))
    small = export_artifact(small_ckpt, work / "art-small",
                            ExportOptions(batch_ladder=(1, 2), context_ladder=(32, 64),
                                          block_size=8, num_blocks=9))
    arts = {"llama": tiny.artifact("llama", False), "qwen3": tiny.artifact("qwen3", True),
            "small": small,
            "llama_int8_fp8kv": tiny.artifact("llama", False, weight_quant="int8", kv_dtype="fp8")}
    repo = work / "repo"
    for name, art in arts.items():
        write_repository(art, repo, name, RepositoryOptions(max_sequence_idle_microseconds=600_000_000))
    write_repository(arts["llama"], repo, "llama_copied",
                     RepositoryOptions(donate_kv_pools=False))
    server = TritonServer(repo, exit_timeout_s=3).start()
    yield server, arts
    server.stop()


def client_for(served, protocol) -> TlalocClient:
    server, _ = served
    return TlalocClient(server.http_url if protocol == "http" else server.grpc_url,
                        "llama", protocol)


def use(client: TlalocClient, model: str) -> TlalocClient:
    client.model = model
    return client


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model,family,tied", [("llama", "llama", False), ("qwen3", "qwen3", True)])
def test_greedy_ids_equal_transformers(served, tiny, protocol, model, family, tied):
    want, _ = reference_greedy(load_reference(tiny.checkpoint(family, tied)), PROMPT, 16)
    with use(client_for(served, protocol), model) as client:
        got = client.generate_greedy(PROMPT, 16)
    assert got.generated_ids == want


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_four_concurrent_sequences_equal_their_solo_runs(served, protocol):
    _, arts = served
    prompts = [PROMPT[:n] for n in (3, 7, 12, 20)]
    engine = Engine(Runtime(arts["llama"]))
    solo = [engine.generate_greedy(p, 12).generated_ids for p in prompts]
    got = [None] * 4
    errors = []

    def run(i):
        try:
            with client_for(served, protocol) as client:
                got[i] = client.generate_greedy(prompts[i], 12).generated_ids
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == solo


def test_donation_in_place_and_the_control_copied_with_the_same_ids(served):
    server, _ = served
    ids = {}
    for model in ("llama", "llama_copied"):
        with use(client_for(served, "grpc"), model) as client:
            ids[model] = client.generate_greedy([1, 5, 9], 101).generated_ids  # 101 runs
    assert ids["llama"] == ids["llama_copied"]
    log = server.log_text()
    assert "[tlaloc llama] KV pools over the first 100 runs: in place 100/100, copied 0/100" in log
    assert "[tlaloc llama_copied] KV pools over the first 100 runs: in place 0/100, copied 100/100" \
        in log


def refused(client, seq_id, tokens, **kw) -> InferError:
    with pytest.raises(InferError) as e:
        client.infer(seq_id, tokens, **kw)
    return e.value


def status_of(err: InferError, protocol: str) -> str:
    """The error's code, read from its status alone: a message may hold a sequence id whose
    digits contain 400 or 503."""
    for name, http, grpc in (("INVALID_ARG", "400", "INVALID_ARGUMENT"),
                             ("UNAVAILABLE", "503", "UNAVAILABLE")):
        if (http if protocol == "http" else grpc) in str(err.status):
            return name
    return f"{err.status} {err}"


def greedy_continue(client, seq_id, logits, steps) -> list[int]:
    import numpy as np
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        logits, _ = client.infer(seq_id, [ids[-1]])
    return ids


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_refusals_leave_the_sequence_to_continue_with_its_solo_ids(served, protocol):
    _, arts = served
    engine = Engine(Runtime(arts["small"]))
    prompt = [1, 17, 99, 3, 200]
    solo = engine.generate_greedy(prompt, 6).generated_ids
    with use(client_for(served, protocol), "small") as client:
        sid = new_sequence_id()
        logits, pages = client.infer(sid, prompt, start=True, want_pages=True)
        assert list(pages) == [1, 0]
        cases = [
            ([5, 256], "INVALID_ARG", "token id 256 is outside the vocabulary [0, 256)"),
            ([-3], "INVALID_ARG", "token id -3 is outside the vocabulary"),
            ([PLACEHOLDER], "INVALID_ARG", "token id 7 is the checkpoint's image_token_id "
                                           "placeholder"),
            ([], "INVALID_ARG", "TOKENS is empty"),
            (list(range(10, 70)), "INVALID_ARG", "65 positions would exceed the largest context 64"),
        ]
        for tokens, code, message in cases:
            err = refused(client, sid, tokens)
            assert status_of(err, protocol) == code, err
            assert message in str(err) and f"sequence {sid}" in str(err)
        assert greedy_continue(client, sid, logits, 6) == solo
        client.infer(sid, [], end=True)
        # a placeholder or an over-long prompt in a START is refused too
        for tokens, message in (([1, PLACEHOLDER], "image_token_id"),
                                (list(range(10, 75)), "largest context 64")):
            err = refused(client, new_sequence_id(), tokens, start=True)
            assert status_of(err, protocol) == "INVALID_ARG" and message in str(err)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_full_pool_refused_as_unavailable_then_the_same_request_succeeds(served, protocol):
    _, arts = served
    engine = Engine(Runtime(arts["small"]))
    prompt_b = list(range(20, 44))  # 24 tokens: 3 pages
    solo_b = engine.generate_greedy(prompt_b, 4).generated_ids
    with use(client_for(served, protocol), "small") as client:
        a, b = new_sequence_id(), new_sequence_id()
        client.infer(a, list(range(60, 100)), start=True)  # 40 tokens: 5 pages
        logits_b, _ = client.infer(b, prompt_b, start=True)  # the pool's last 3 pages
        first = int(logits_b.argmax())
        err = refused(client, b, [first])  # position 24 needs a fourth page
        assert status_of(err, protocol) == "UNAVAILABLE", err
        assert "KV pool full" in str(err)
        assert re.search(rf"{a} \(5 pages\), {b} \(3 pages\)", str(err))
        client.infer(a, [], end=True)
        logits, pages = client.infer(b, [first], want_pages=True)  # the same request again
        assert list(pages) == [4, 0]
        assert [first] + greedy_continue(client, b, logits, 3) == solo_b
        client.infer(b, [], end=True)
        # a sequence at the largest context: one more step is refused by name
        c = new_sequence_id()
        logits, _ = client.infer(c, list(range(100, 163)), start=True)
        logits, pages = client.infer(c, [int(logits.argmax())], want_pages=True)
        assert list(pages) == [8, 0]
        err = refused(client, c, [int(logits.argmax())])
        assert status_of(err, protocol) == "INVALID_ARG"
        assert "65 positions would exceed the largest context 64" in str(err)
        client.infer(c, [], end=True)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_int8_weights_and_fp8_kv_served(served, tiny, protocol):
    """int8 linears and fp8 KV pools through Triton: transformers computing with the dequantized
    weights and e4m3fn-rounded keys and values gives the same ids; the metrics report the
    weight and pool bytes."""
    from oracle import fp8_kv_reference, quantized_reference

    from triton_tlaloc.frontends.client import METRICS_SETTLE_S, metric, scrape_metrics

    server, arts = served
    model = quantized_reference(load_reference(tiny.checkpoint("llama", False)), "int8")
    with fp8_kv_reference(model):
        want, _ = reference_greedy(model, PROMPT, 16)
    with use(client_for(served, protocol), "llama_int8_fp8kv") as client:
        assert client.generate_greedy(PROMPT, 16).generated_ids == want
    metrics = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    quant, plain = load_artifact(arts["llama_int8_fp8kv"]), load_artifact(arts["llama"])

    def device_bytes(model, what):
        return metric(metrics, "tlaloc_device_bytes", model=model, what=what)
    assert device_bytes("llama_int8_fp8kv", "weights") == sum(w.byte_length for w in quant.weights)
    assert device_bytes("llama_int8_fp8kv", "weights") < 0.5 * device_bytes("llama", "weights")
    assert device_bytes("llama_int8_fp8kv", "kv_pools") * 4 == device_bytes("llama", "kv_pools")
    assert plain.model.kv_dtype == "f32" and quant.model.kv_dtype == "f8E4M3FN"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_small_outputs_on_every_step(served, protocol):
    """ARGMAX equals the argmax of LOGITS on each step of a 32-step run, TOP_K their K largest
    log-probabilities; a request naming only ARGMAX gets 4 bytes and no LOGITS; the greedy ids
    through ARGMAX equal those through LOGITS; a bad top_k is refused by name."""
    import numpy as np

    with use(client_for(served, protocol), "llama") as client:
        sid = new_sequence_id()
        out = client.request(sid, PROMPT[:5], start=True, top_k=4,
                             outputs=("LOGITS", "ARGMAX", "TOP_K_IDS", "TOP_K_LOGPROBS"))
        for _ in range(32):
            logits = out["LOGITS"]
            assert out["ARGMAX"].tolist() == [int(np.argmax(logits))]
            z = logits.astype(np.float64)
            top = np.argsort(-logits, kind="stable")[:4]
            assert out["TOP_K_IDS"].tolist() == top.tolist()
            np.testing.assert_allclose(out["TOP_K_LOGPROBS"],
                                       z[top] - z.max() - np.log(np.exp(z - z.max()).sum()),
                                       rtol=1e-5)
            out = client.request(sid, [int(out["ARGMAX"][0])], top_k=4,
                                 outputs=("LOGITS", "ARGMAX", "TOP_K_IDS", "TOP_K_LOGPROBS"))
        small = client.request(sid, [int(out["ARGMAX"][0])], outputs=("ARGMAX",))
        assert set(small) == {"ARGMAX"} and sum(a.nbytes for a in small.values()) == 4
        assert out["LOGITS"].nbytes == 256 * 4
        with pytest.raises(InferError, match="parameter top_k 0"):
            client.request(sid, [1], outputs=("TOP_K_IDS",), top_k=0)
        client.infer(sid, [], end=True)
        by_logits = client.generate_greedy(PROMPT, 16).generated_ids
        assert client.generate_greedy(PROMPT, 16, argmax_output=True).generated_ids == by_logits


def test_metrics_on_the_metrics_port(served):
    from triton_tlaloc.frontends.client import METRICS_SETTLE_S, metric, scrape_metrics

    server, _ = served
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    with use(client_for(served, "http"), "llama") as client:
        client.generate_greedy([1, 2, 3], 5)
        with pytest.raises(InferError):
            client.infer(new_sequence_id(), [1, 999], start=True)
    after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)

    def delta(name, **labels):
        return metric(after, name, model="llama", **labels) - metric(before, name, model="llama",
                                                                     **labels)
    assert delta("tlaloc_executions_total", kind="prefill") == 1
    assert delta("tlaloc_executions_total", kind="decode") == 4
    assert delta("tlaloc_tokens_total", kind="prefill") == 3
    assert delta("tlaloc_tokens_total", kind="decode") == 4
    assert delta("tlaloc_refusals_total", reason="token") == 1
    assert delta("tlaloc_backend_wait_seconds_count") == 5
    assert delta("tlaloc_execution_seconds_count", kind="decode") == 4
    assert delta("tlaloc_batch_size_bucket", kind="decode", le="1") == 4
    assert metric(after, "tlaloc_kv_pages_used", model="llama", pool="full") == 0
    assert metric(after, "tlaloc_kv_pages_free", model="llama", pool="full") == 32
    assert metric(after, "tlaloc_sequences_held", model="llama") == 0
    art = load_artifact(served[1]["llama"])
    assert metric(after, "tlaloc_device_bytes", model="llama", what="weights") == sum(
        w.byte_length for w in art.weights)
    m = art.model  # K and V of each layer, f32
    assert metric(after, "tlaloc_device_bytes", model="llama", what="kv_pools") == len(
        art.pools) * m.num_blocks * m.block_size * m.kv_heads * m.head_size * 4
    # The step phases (batcher.CallTiming): the executable's share of the decode calls' time.
    assert delta("tlaloc_call_phase_seconds_total", kind="decode", phase="execute") > 0
    assert delta("tlaloc_response_send_seconds_count") >= 6

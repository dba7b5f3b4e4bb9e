"""LoRA adapters through a real tritonserver, as `tlaloc repository --lora NAME=DIR` and a
server started without waiting for its compiles give them: sequences of adapter a, adapter b
and none, over HTTP and gRPC all at once (the adapters' rows batched in the same calls), each
get transformers + PEFT's greedy ids, and so do they drafted by the base model (the target
verifying with the adapter); an unknown adapter and a later request naming another
adapter are refused by name; a model whose artifact takes no adapters refuses `lora`; the
adapter metrics count the loads and the sequences by adapter. Through `tlaloc openai` (a small
BPE tokenizer beside the tiny model; prompts as token ids), each adapter is a model of its own
name giving the same ids, and an adapter loaded and unloaded through its admin routes while
other adapters' completions run leaves their ids right and no page or slot held. Prompts of
adapters joining an adapter's stream ride its steps (mixed entries) with the same ids."""

from __future__ import annotations

import threading
import time

import pytest
from checks.mixed_checks import check_prompts_join_a_stream
from checks.sequence_checks import assert_check, run_parallel, url_of
from test_lora import OPTS, PROMPTS, STEPS, lora_setup, reference

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, InferError, TlalocClient,
                                            generate, new_sequence_id, scrape_metrics)
from triton_tlaloc.frontends.openai_adapters import ADMIN_HEADER
from triton_tlaloc.frontends.openai_server import ServedModel, ServerOptions, serve_in_thread
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

# (adapter, prompt) of each sequence
RUNS = [("a", PROMPTS[0]), ("b", PROMPTS[1]), (None, PROMPTS[2])]
ADMIN_KEY = "admin-0123"  # the server's (tlaloc serve --admin-key), which lora_admin needs


@pytest.fixture(scope="module")
def served(tiny, work):
    base, art, adapters = lora_setup(tiny)
    repo = work / "repo-lora"
    write_repository(art, repo, "lora", RepositoryOptions(
        lora=tuple((name, str(path)) for name, path in adapters.items()),
        lora_updates_root=str(tiny.run_dir),  # (where the tests' adapters are made)
        draft_model="plain"))  # the base model drafts, the target verifies with the adapter
    write_repository(tiny.artifact("llama", False), repo, "plain",
                     RepositoryOptions(generate_model=False))
    # the same with mixed entries (as `tlaloc export` writes them for adapter pools), ready
    # once every entry is compiled, and a cohort wait a loaded machine's round trip fits in
    write_repository(tiny.artifact("llama", False, **OPTS, mixed_tokens=(16,)), repo,
                     "lora_mixed", RepositoryOptions(
                         lora=tuple((name, str(path)) for name, path in adapters.items()),
                         lora_updates_root=str(tiny.run_dir), background_compile=False,
                         cohort_wait_microseconds=500_000))
    # six adapters for two slots
    many = {f"c{k}": tiny.lora_adapter("llama", f"c{k}", 2 + k, seed=10 + k) for k in range(6)}
    write_repository(tiny.artifact("llama", False, **{**OPTS, "lora_slots": 2}), repo,
                     "cycling", RepositoryOptions(
                         lora=tuple((n, str(p)) for n, p in many.items()), generate_model=False))
    want = [reference(base, adapters[a] if a else None, p)[0] for a, p in RUNS]
    want_many = {n: reference(base, p, PROMPTS[k % 3])[0] for k, (n, p) in enumerate(many.items())}
    server = TritonServer(repo, exit_timeout_s=3, admin_key=ADMIN_KEY).start(wait_compiled=False)
    yield server, want, want_many
    server.stop()


def test_adapters_over_http_grpc_and_the_generate_model_at_once_give_transformers_peft_ids(
        served):
    server, want, _ = served
    jobs = [(via, i) for via in ("http", "grpc", "generate", "drafted")
            for i in range(len(RUNS))]
    got = {}

    def send(n):
        via, i = jobs[n]
        adapter, prompt = RUNS[i]
        if via in ("generate", "drafted"):  # the sampling parameter lora, the loop in the
            # model's process; drafted: 2 drafts a step by the base model, served beside it
            drafts = {"speculative": {"method": "draft_model", "num_draft_tokens": 2,
                                      "adaptive": False}}  # (a draft model as large drafts 0)
            r = generate(server.grpc_url, "lora_generate", input_ids=prompt, sampling={
                "max_tokens": STEPS, "ignore_eos": True, **({"lora": adapter} if adapter else {}),
                **(drafts if via == "drafted" else {})})
            got[jobs[n]] = r.token_ids if r.error is None else r.error
            return
        with TlalocClient(url_of(server, via), "lora", via) as c:
            got[jobs[n]] = c.generate_greedy(prompt, STEPS, lora=adapter).generated_ids
    run_parallel(send, len(jobs))
    assert {job: ids for job, ids in got.items()} == {
        (via, i): want[i] for via, i in jobs}
    # the metrics: both adapters written into their slots once, each started twice
    metrics = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)

    def value(name, **labels):
        return sum(v for (m, got), v in metrics.items() if m == name and ("model", "lora") in got
                   and all((k, v) in got for k, v in labels.items()))
    assert value("tlaloc_lora_sequences_total", adapter="a") >= 3
    assert value("tlaloc_lora_sequences_total", adapter="b") >= 3
    assert value("tlaloc_lora_adapter_moves_total", move="load") == 2
    assert value("tlaloc_draft_tokens_total") > 0  # the drafted runs' drafts were verified
    assert value("tlaloc_lora_adapters", where="device") == 2


def test_adapter_prompts_joining_an_adapter_stream_ride_its_steps_with_the_same_ids(served):
    """Mixed steps with adapters as `tlaloc serve` runs them: a stream of adapter a decodes
    while prompts of adapter b, none and a arrive through the generate model; steps carried
    their chunks and the stream's row together, and every id is the model's apart (the same
    adapters, no mixed entries)."""
    server, _, _ = served
    assert_check(check_prompts_join_a_stream(
        server.grpc_url, server.metrics_url, "lora_mixed", "lora", lengths=(20, 40, 30),
        new_tokens=8, stream_tokens=40, stream_lora="a", loras=("b", None, "a")))


def test_unknown_adapters_and_another_adapter_later_are_refused_by_name(served):
    server, _, _ = served
    with TlalocClient(server.grpc_url, "lora", "grpc") as c:
        with pytest.raises(InferError, match=r"unknown adapter 'nope' \(loaded: a, b\)"):
            c.request(new_sequence_id(), PROMPTS[0], start=True, lora="nope")
        seq = new_sequence_id()
        c.request(seq, PROMPTS[0], start=True, lora="a")
        with pytest.raises(InferError, match="its adapter is a, set by its START"):
            c.request(seq, [5], lora="b")
        c.request(seq, [5], end=True)  # the sequence was untouched by the refusal
    with TlalocClient(server.http_url, "plain", "http") as c:
        with pytest.raises(InferError, match="this model takes no adapters"):
            c.request(new_sequence_id(), PROMPTS[0], start=True, lora="a")


def test_more_adapters_than_slots_cycle_through_them_with_no_refusal(served):
    """Six adapters, two slots, three users at once, each starting four sequences with the
    next adapters in turn: every sequence gets its adapter's ids (a START waits while both
    slots are in use, then takes the slot of an adapter no sequence uses); the adapters were
    written into slots again and again, and nothing was refused."""
    server, _, want = served
    names = sorted(want)
    got = {}

    def user(u):
        with TlalocClient(server.grpc_url, "cycling", "grpc") as c:
            for turn in range(4):
                name = names[(u + 2 * turn) % len(names)]
                k = names.index(name)
                got[u, turn] = (name, c.generate_greedy(PROMPTS[k % 3], STEPS,
                                                        lora=name).generated_ids)
    run_parallel(user, 3)
    assert len(got) == 12 and all(ids == want[name] for name, ids in got.values())
    metrics = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    loads = sum(v for (m, labels), v in metrics.items() if m == "tlaloc_lora_adapter_moves_total"
                and ("model", "cycling") in labels and ("move", "load") in labels)
    refused = sum(v for (m, labels), v in metrics.items() if m == "tlaloc_refusals_total"
                  and ("model", "cycling") in labels)
    assert loads >= 6 and refused == 0, (loads, refused)


def test_an_adapter_loaded_and_unloaded_while_serving(served, tiny):
    """The request parameter lora_admin (what tlaloc openai's /v1/load_lora_adapter sends),
    with the server's admin key: an adapter loaded from under lora_updates_root serves its ids;
    one outside it is refused by name; unloading it while a sequence uses it is refused, after
    that sequence's END it is gone (a START naming it: unknown). Without the key (missing or
    wrong, over HTTP and gRPC: Triton's inference port is open to every client) a load and an
    unload are refused by name and change nothing."""
    server, _, want = served
    path = tiny.lora_adapter("llama", "c0", 2, 10).name
    with TlalocClient(server.grpc_url, "lora", "grpc") as c, \
            TlalocClient(server.http_url, "lora", "http") as h:
        def admin(command, key=ADMIN_KEY, client=c):
            client.request(new_sequence_id(), [], start=True, end=True, outputs=("KV_PAGES",),
                           admin=command, admin_key=key)

        def refused_without_the_key(command):
            for client in (c, h):
                for key in (None, "wrong"):
                    with pytest.raises(InferError, match="admin key .* is missing or wrong"):
                        admin(command, key, client)
        refused_without_the_key({"load": {"name": "late", "path": path}})
        with pytest.raises(InferError, match="unknown adapter 'late'"):
            c.request(new_sequence_id(), PROMPTS[0], start=True, lora="late")
        with pytest.raises(InferError, match="is outside the directory adapters may be"):
            admin({"load": {"name": "late", "path": "../elsewhere"}})
        admin({"load": {"name": "late", "path": path}})
        refused_without_the_key({"unload": "late"})
        assert c.generate_greedy(PROMPTS[0], STEPS, lora="late").generated_ids == want["c0"]
        seq = new_sequence_id()
        c.request(seq, PROMPTS[0], start=True, lora="late")
        with pytest.raises(InferError, match="adapter late is in use by 1 live sequence"):
            admin({"unload": "late"})
        c.request(seq, [5], end=True)
        admin({"unload": "late"})
        with pytest.raises(InferError, match="unknown adapter 'late'"):
            c.request(new_sequence_id(), PROMPTS[0], start=True, lora="late")


def test_adapters_through_tlaloc_openai_loaded_and_unloaded_while_others_serve(served, tiny,
                                                                             tmp_path):
    import openai
    from checks.taught_model import write_tokenizer

    server, want, want_many = served
    write_tokenizer(tmp_path / "tokenizer")  # (256 ids, as the tiny model's vocabulary)
    models = ServedModel.discover_with_adapters(server.grpc_url, "lora",
                                                tokenizer_dir=str(tmp_path / "tokenizer"))
    base_url, stop = serve_in_thread(server.grpc_url, models,
                                     options=ServerOptions(admin_key=ADMIN_KEY))
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    admin = openai.OpenAI(base_url=base_url, api_key="unused",
                          default_headers={ADMIN_HEADER: ADMIN_KEY})

    def complete(model, prompt):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=STEPS,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
        return r.model_dump()["choices"][0]["token_ids"]

    done, wrong, runs = threading.Event(), [], []

    def together():
        got = {}
        run_parallel(lambda i: got.__setitem__(i, complete(RUNS[i][0] or "lora", RUNS[i][1])),
                     len(RUNS))
        return [got[i] for i in range(len(RUNS))]

    def traffic(i):
        while not done.is_set():
            ids = complete(RUNS[i][0] or "lora", RUNS[i][1])
            runs.append(i)
            if ids != want[i]:
                wrong.append((i, ids))

    try:
        assert {m.id for m in client.models.list()} == {"lora", "a", "b"}
        assert together() == want  # adapters a, b and none in the same calls
        # adapter a and the base model served while c1 is loaded as "late", used, unloaded
        threads = [threading.Thread(target=traffic, args=(i,)) for i in (0, 2)]
        for t in threads:
            t.start()
        path = tiny.lora_adapter("llama", "c1", 3, 11).name  # (under lora_updates_root)
        admin.post("/load_lora_adapter", body={"lora_name": "late", "lora_path": path},
                   cast_to=str)
        assert complete("late", PROMPTS[1]) == want_many["c1"]
        admin.post("/unload_lora_adapter", body={"lora_name": "late"}, cast_to=str)
        with pytest.raises(openai.NotFoundError):
            complete("late", PROMPTS[1])
        started = len(runs)
        while len(runs) < started + 2 and all(t.is_alive() for t in threads):
            time.sleep(0.05)  # the others' completions go on after the unload
        done.set()
        for t in threads:
            t.join(60)
        assert not wrong and len(runs) >= started + 2, (wrong, runs)
        # no slot left held: a and b each take one of the two at once again
        assert together() == want
    finally:
        done.set()
        stop()
    metrics = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)

    def value(name, **labels):
        return sum(v for (m, got), v in metrics.items() if m == name and ("model", "lora") in got
                   and all((k, v) in got for k, v in labels.items()))
    assert value("tlaloc_kv_pages_used") == 0 and value("tlaloc_sequences_held") == 0
    assert value("tlaloc_lora_adapters", where="host") == 2  # a and b: "late" is gone

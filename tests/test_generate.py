"""The generate model (decoupled, beside each sequence model): generation on the server,
streamed over gRPC, with sampling, stop conditions and cancellation, against the sequence
model's client-side greedy ids (generation/sampling.py alone: tests/unit/test_sampling.py)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, TlalocClient, generate, generate_http,
                                            metric, new_sequence_id, scrape_metrics)
from checks.schemas import ASK_PERSON, PERSON, TOO_MANY_ALTERNATIVES, masked_greedy

from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.repository import RepositoryOptions, write_generate_model, write_repository
from triton_tlaloc.triton.server import TritonServer
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer

pytestmark = pytest.mark.tritonserver

PROMPT = [1, 17, 99, 3, 200, 41, 7, 88]
_GREEDY: dict = {}


def greedy(server, model: str, prompt: list[int], steps: int) -> list[int]:
    """The sequence model's client-side greedy ids, asked once per server (several tests
    compare with the same ones; SmolLM2's take a second or more each)."""
    key = (server.grpc_url, model, tuple(prompt), steps)
    if key not in _GREEDY:
        with TlalocClient(server.grpc_url, model) as c:
            _GREEDY[key] = c.generate_greedy(prompt, steps).generated_ids
    return _GREEDY[key]


@pytest.fixture(scope="module")
def served(tiny, smollm2, smollm2_chat, taught, work):
    repo = work / "repo-generate"
    write_repository(tiny.artifact("llama", False), repo, "llama",
                     RepositoryOptions(max_sequence_idle_microseconds=600_000_000))
    write_repository(smollm2[1], repo, "smollm2", RepositoryOptions())
    write_repository(smollm2_chat, repo, "smollm2_chat", RepositoryOptions())  # tools
    write_repository(taught, repo, "taught", RepositoryOptions())  # a model's own tool call
    # The same sequence models' generate models with the loop in their own process, a BLS
    # call a token (NAME_generate_bls)
    for name, art in (("llama", tiny.artifact("llama", False)), ("smollm2", smollm2[1])):
        write_generate_model(load_artifact(art), repo, name, "bls", f"{name}_generate_bls")
    # Draft models: llama with verify entries drafts with llama (its own weights: every draft
    # right), with qwen3 (another model of the same vocabulary: most drafts wrong), and with
    # SmolLM2 (another vocabulary: refused)
    spec = tiny.artifact("llama", False, verify_tokens=(5, 9))
    write_repository(spec, repo, "llama_spec", RepositoryOptions(draft_model="llama"))
    write_repository(tiny.artifact("qwen3", True), repo, "qwen3",
                     RepositoryOptions(generate_model=False))
    for draft in ("qwen3", "smollm2"):
        write_generate_model(load_artifact(spec), repo, "llama_spec", "local",
                             f"llama_spec_generate_{draft}", draft_model=draft)
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    yield server, ArtifactTokenizer(smollm2[1] / "tokenizer")
    server.stop()


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "one response"])
def test_greedy_generation_equals_the_sequence_models_greedy_ids(served, stream, loop):
    """SmolLM2, 32 tokens of a chat prompt: the generate model's ids equal the client-side
    greedy ids of the sequence model, its text is their decoding, and the final response
    counts the tokens. The local loop's last token comes in its final response; the BLS
    loop's final response is one of its own."""
    server, tok = served
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about "
                                                                  "the sea."}])
    want = greedy(server, "smollm2", prompt, 32)
    got = generate(server.grpc_url, f"smollm2_generate{loop}", input_ids=prompt,
                   stream=stream, sampling={"max_tokens": 32, "ignore_eos": True})
    assert got.error is None and got.token_ids == want
    assert got.text == tok.decode(want)
    assert (got.finish_reason, got.prompt_tokens, got.completion_tokens) == ("length",
                                                                               len(prompt), 32)
    if not stream:
        assert got.responses == 1
    elif loop:
        assert got.responses == 33
    else:  # a response a token, or several tokens to a response when the sends fall behind
        assert 2 <= got.responses <= 32


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
def test_text_input_stops_at_end_of_sequence_and_at_a_stop_string(served, loop):
    server, tok = served
    chat = tok.decode(tok.apply_chat_template([{"role": "user",
                                                "content": "What is the capital of France?"}]))
    got = generate(server.grpc_url, f"smollm2_generate{loop}", text=chat,
                   sampling={"max_tokens": 64})
    assert got.finish_reason == "stop" and "Paris" in got.text  # its end-of-sequence token
    assert got.completion_tokens < 64
    cut = generate(server.grpc_url, f"smollm2_generate{loop}", text=chat,
                   sampling={"max_tokens": 64, "stop": ["Paris"]})
    assert cut.finish_reason == "stop" and "Paris" not in cut.text
    assert got.text.startswith(cut.text) and got.text[len(cut.text):].startswith("Paris")
    # Past its end (ignore_eos), the end token's text is left out unless skip_special_tokens
    # is false
    past = {"max_tokens": got.completion_tokens + 2, "ignore_eos": True}
    skipped = generate(server.grpc_url, f"smollm2_generate{loop}", text=chat, sampling=past)
    kept = generate(server.grpc_url, f"smollm2_generate{loop}", text=chat,
                    sampling={**past, "skip_special_tokens": False})
    end = tok.token_text(kept.token_ids[got.completion_tokens])
    assert end.startswith("<|") and kept.token_ids == skipped.token_ids
    assert kept.text.startswith(got.text + end) and end not in skipped.text


def test_seeded_sampling_repeats_exactly(served):
    """The same seed gives the same ids in either loop (the sampler is the same code, in the
    sequence model's process or the generate model's)."""
    server, _ = served

    def sample(seed, loop="", **extra):
        return generate(server.grpc_url, f"llama_generate{loop}", input_ids=PROMPT, sampling={
            "max_tokens": 24, "temperature": 1.0, "seed": seed, "ignore_eos": True,
            **extra}).token_ids
    first = sample(11)
    assert sample(11) == first and sample(12) != first
    assert sample(11, "_bls") == first
    greedy = generate(server.grpc_url, "llama_generate", input_ids=PROMPT,
                      sampling={"max_tokens": 24, "ignore_eos": True}).token_ids
    assert sample(13, top_k=1) == greedy  # top_k 1 is greedy whatever the seed


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
def test_cancelling_a_generation_frees_its_pages_and_others_go_on(served, loop):
    """SmolLM2, whose steps (~27 ms) leave time to cancel: the local loop runs a generation at
    the engine's pace, not the client's, so the tiny llama's ~1 ms steps would finish 200
    tokens before a cancel could reach them."""
    server, _ = served
    model = f"smollm2_generate{loop}"
    want = greedy(server, "smollm2", PROMPT, 24)
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    other = {}

    def run_other():
        other["result"] = generate(server.grpc_url, model, input_ids=PROMPT,
                                   sampling={"max_tokens": 24, "ignore_eos": True})
    thread = threading.Thread(target=run_other)
    thread.start()
    cancelled = generate(server.grpc_url, model, input_ids=PROMPT[:5],
                         sampling={"max_tokens": 200, "ignore_eos": True}, cancel_after=3)
    thread.join(120)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 200
    assert other["result"].token_ids == want  # the other generation went on

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)
    # The metrics are applied every 250 ms by each model's own writer: poll (a loaded machine
    # may take a few periods).
    for _ in range(20):
        after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        if (metric(after, "tlaloc_sequences_held", model="smollm2") == 0
                and delta("tlaloc_generations_total", model=model, reason="cancelled") > 0):
            break
    assert metric(after, "tlaloc_kv_pages_used", model="smollm2", pool="full") == 0
    assert metric(after, "tlaloc_sequences_held", model="smollm2") == 0
    assert delta("tlaloc_generations_total", model=model, reason="cancelled") == 1
    assert delta("tlaloc_generations_total", model=model, reason="length") == 1
    assert delta("tlaloc_time_to_first_token_seconds_count", model=model) == 2


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
def test_bad_requests_get_one_error_naming_the_problem(served, loop):
    server, _ = served
    for kwargs, message in (
            (dict(input_ids=PROMPT, sampling={"temperature": -1}), "temperature -1.0"),
            (dict(text="hello"), "text_input needs the artifact's tokenizer"),
            (dict(input_ids=[5, 999]), "token id 999 is outside the vocabulary"),
            (dict(), "send text_input or input_ids")):
        got = generate(server.grpc_url, f"llama_generate{loop}", **kwargs)
        assert got.error is not None and message in got.error, (kwargs, got)
        assert got.responses == 1


# ------------------------------------------------------------------ speculation

EDIT = ("Rename total to acc:\n"
        "def add(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total")


def speculative(k: int, **extra) -> dict:
    return {"max_tokens": 40, "ignore_eos": True,
            "speculative": {"num_draft_tokens": k, **extra}}


@pytest.mark.parametrize("protocol, settings", [
    ("grpc", ((1, False), (2, False), (4, True))), ("http", ((8, False), (8, True)))])
def test_speculative_generation_gives_the_greedy_ids(served, protocol, settings):
    """SmolLM2 asked to edit code (its answer repeats the prompt, so prompt lookup drafts
    well): with 1, 2, 4 and 8 drafts a step, fixed or adaptive (shared between the two
    protocols: the drafting is the server's, the same whichever carries the request), the
    generate model's ids equal the sequence model's greedy ids without drafts, over gRPC and
    HTTP (Triton's generate extension), and drafts were verified and accepted (the sequence
    model's counters)."""
    server, tok = served
    url, send = ((server.grpc_url, generate) if protocol == "grpc" else
                 (server.http_url, generate_http))
    prompt = tok.apply_chat_template([{"role": "user", "content": EDIT}])
    assert len(prompt) + 40 <= 128, len(prompt)
    want = greedy(server, "smollm2", prompt, 40)
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    for k, adaptive in settings:
        got = send(url, "smollm2_generate", input_ids=prompt,
                   sampling=speculative(k, adaptive=adaptive))
        assert got.error is None and got.token_ids == want, (k, adaptive, got.error)
        assert (got.finish_reason, got.completion_tokens) == ("length", 40)
    after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)

    def delta(name):
        return metric(after, name, model="smollm2") - metric(before, name, model="smollm2")
    drafted, accepted = delta("tlaloc_draft_tokens_total"), delta(
        "tlaloc_accepted_draft_tokens_total")
    assert drafted > 0 and 0.1 * drafted < accepted <= drafted, (drafted, accepted)


def test_speculation_beside_plain_generations_and_in_every_loop(served):
    """A speculating generation and two plain ones at once (their steps share calls): each
    equals its greedy ids alone. The BLS loop decodes a token a step whatever `speculative`
    says (the same ids); a sampled generation that speculates with top_k 1 is greedy too; a
    model without verify entries refuses speculation by name in one response."""
    server, tok = served
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}])
               for c in (EDIT, "Tell me a joke.", "What is 2 + 2?")]
    wants = [greedy(server, "smollm2", p, 40) for p in prompts]
    got = [None] * 3

    def run(i, sampling):
        got[i] = generate(server.grpc_url, "smollm2_generate", input_ids=prompts[i],
                          sampling=sampling)
    threads = [threading.Thread(target=run, args=(i, speculative(6) if i == 0 else
                                                  {"max_tokens": 40, "ignore_eos": True}))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [g.token_ids for g in got] == wants
    bls = generate(server.grpc_url, "smollm2_generate_bls", input_ids=prompts[0],
                   sampling=speculative(4))
    assert bls.token_ids == wants[0]
    sampled = generate(server.grpc_url, "smollm2_generate", input_ids=prompts[0],
                       sampling={**speculative(4), "temperature": 0.9, "top_k": 1, "seed": 5})
    assert sampled.error is None and sampled.token_ids == wants[0]
    refused = generate(server.grpc_url, "llama_generate", input_ids=PROMPT,
                       sampling=speculative(4))
    assert refused.responses == 1 and refused.status == "INVALID_ARGUMENT"
    assert "speculative: the artifact has no verify entries" in refused.error


def drafting(k: int, **extra) -> dict:
    return {"max_tokens": 32, "ignore_eos": True,
            "speculative": {"method": "draft_model", "num_draft_tokens": k, **extra}}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_drafting_with_a_draft_model_gives_the_greedy_ids(served, protocol):
    """The tiny llama with verify entries drafting with a draft model served beside it: with
    its twin (the same weights, so every draft is right) and with qwen3 (most drafts wrong),
    at 1, 2, 4 and 8 drafts a step, fixed and adaptive, the ids equal the sequence model's
    greedy ids; the twin's drafts all stand, qwen3's mostly do not (the target's counters)."""
    server, _ = served
    url, send = ((server.grpc_url, generate) if protocol == "grpc" else
                 (server.http_url, generate_http))
    want = greedy(server, "llama_spec", PROMPT, 32)
    for model, right in (("llama_spec_generate", True), ("llama_spec_generate_qwen3", False)):
        before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        for k, adaptive in ((1, False), (2, False), (4, True), (8, False)):
            got = send(url, model, input_ids=PROMPT, sampling=drafting(k, adaptive=adaptive))
            assert got.error is None and got.token_ids == want, (model, k, got.error)
            assert (got.finish_reason, got.completion_tokens) == ("length", 32)
        after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        drafted, accepted = (metric(after, name, model="llama_spec")
                             - metric(before, name, model="llama_spec")
                             for name in ("tlaloc_draft_tokens_total",
                                          "tlaloc_accepted_draft_tokens_total"))
        assert drafted > 0, model
        assert (accepted == drafted) if right else (accepted < 0.5 * drafted), (
            model, drafted, accepted)


def test_a_draft_model_beside_plain_generations_sampled_and_refused(served):
    """Drafting generations and a plain one at once, each its greedy ids alone; sampled at
    top_k 1, greedy; refused by name in one response where the generate model names no draft
    model, and where the draft model has another vocabulary."""
    server, _ = served
    prompts = [PROMPT, PROMPT[2:], PROMPT[:5]]
    wants = [greedy(server, "llama_spec", p, 32) for p in prompts]
    got = [None] * 3

    def run(i, model, sampling):
        got[i] = generate(server.grpc_url, model, input_ids=prompts[i], sampling=sampling)
    threads = [threading.Thread(target=run, args=args) for args in (
        (0, "llama_spec_generate", drafting(4)), (1, "llama_spec_generate_qwen3", drafting(3)),
        (2, "llama_spec_generate", {"max_tokens": 32, "ignore_eos": True}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [g.token_ids for g in got] == wants
    sampled = generate(server.grpc_url, "llama_spec_generate_qwen3", input_ids=PROMPT,
                       sampling={**drafting(4), "temperature": 0.9, "top_k": 1, "seed": 5})
    assert sampled.error is None and sampled.token_ids == wants[0]
    for model, says in (("llama_generate", "llama_generate names no draft model"),
                        ("llama_spec_generate_smollm2", "draft model smollm2 has a vocabulary "
                                                        "of 49152 tokens, this model 256")):
        refused = generate(server.grpc_url, model, input_ids=PROMPT, sampling=drafting(4))
        assert refused.responses == 1 and refused.status == "INVALID_ARGUMENT", refused
        assert says in refused.error and "speculative.method draft_model" in refused.error


# ------------------------------------------------------------------ tlaloc openai

@pytest.fixture(scope="module")
def openai_url(served):
    """`tlaloc openai` in front of smollm2_generate, smollm2_chat_generate (a context of 512,
    for tools) and taught_generate (its parsers auto), on a free loopback port."""
    from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread

    server, _ = served
    base_url, stop = serve_in_thread(server.grpc_url, {
        name: ServedModel.discover(server.grpc_url, name)
        for name in ("smollm2", "smollm2_chat", "taught")})
    yield base_url
    stop()


def test_the_openai_client_gets_the_generate_models_text(served, openai_url):
    """The `openai` package against `tlaloc openai`: a chat completion, streamed and not, has
    the text the generate model gives for the same chat-template ids; /v1/models and
    /v1/completions answer too."""
    import openai

    server, tok = served
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = generate(server.grpc_url, "smollm2_generate",
                    input_ids=tok.apply_chat_template(messages), sampling={"max_tokens": 24})
    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2", "smollm2_chat", "taught"]
    chat = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                          max_tokens=24)
    assert chat.choices[0].message.content == want.text and "Paris" in want.text
    assert chat.choices[0].finish_reason == want.finish_reason
    assert chat.usage.completion_tokens == want.completion_tokens
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages,
                                                 temperature=0, max_tokens=24, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    text = client.completions.create(model="smollm2", prompt="The capital of France is",
                                     temperature=0, max_tokens=8)
    plain = generate(server.grpc_url, "smollm2_generate", text="The capital of France is",
                     sampling={"max_tokens": 8})
    assert text.choices[0].text == plain.text
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="nope", messages=messages)


def test_the_openai_extension_field_speculative(served, openai_url):
    """`speculative` in an OpenAI body (the openai package's extra_body): the same text as
    without it at temperature 0; a value of the wrong JSON type or range is a 400 naming it."""
    import openai

    server, tok = served
    messages = [{"role": "user", "content": EDIT}]
    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    plain = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                           max_tokens=32)
    fast = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=32,
        extra_body={"speculative": {"method": "prompt_lookup", "num_draft_tokens": 6}})
    assert fast.choices[0].message.content == plain.choices[0].message.content
    for bad, says in ((4, "speculative: a JSON object"),
                      ({"num_draft_tokens": 0}, "speculative.num_draft_tokens 0")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.chat.completions.create(model="smollm2", messages=messages,
                                           extra_body={"speculative": bad})


def test_the_repository_command_names_the_draft_model(tiny, tmp_path):
    from triton_tlaloc.cli import main

    art = tiny.artifact("llama", False)
    assert main(["repository", str(art), str(tmp_path), "--name", "big",
                 "--draft-model", "small"]) == 0
    text = (tmp_path / "big_generate" / "config.pbtxt").read_text()
    assert '{ key: "draft_model" value: { string_value: "small" } }' in text
    assert main(["repository", str(art), str(tmp_path), "--name", "plain"]) == 0
    text = (tmp_path / "plain_generate" / "config.pbtxt").read_text()
    assert '{ key: "draft_model" value: { string_value: "" } }' in text


# ------------------------------------------------------------------ structured output



def validated(text: str) -> dict:
    import jsonschema

    answer = json.loads(text)
    jsonschema.validate(answer, PERSON)
    return answer


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
def test_structured_output_gives_json_that_validates_in_every_loop(served, loop):
    """SmolLM2 asked for a person under a held-out JSON schema, greedy (over gRPC and over
    HTTP) and sampled (temperature, top-k and top-p, seeded): every answer parses, validates
    and ends by stop, and the grammar metrics count them on the model whose loop chose."""
    server, tok = served
    prompt = tok.apply_chat_template(ASK_PERSON)
    model = f"smollm2_generate{loop}"
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    for url, send, sampling in (
            (server.grpc_url, generate, {}),
            (server.http_url, generate_http, {}),
            (server.grpc_url, generate, {"temperature": 1.2, "top_k": 20, "top_p": 0.95,
                                         "seed": 2})):
        sampling = {**sampling, "max_tokens": 80,
                    "structured_output": {"json_schema": PERSON}}
        got = send(url, model, input_ids=prompt, sampling=sampling)
        assert got.error is None and got.finish_reason == "stop", (sampling, got)
        validated(got.text)
    # the local loop's grammars report to the sequence model's metrics, the BLS loop's to
    # its generate model's
    reporter = "smollm2_generate_bls" if loop else "smollm2"

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)
    for _ in range(20):  # applied every 250 ms by the model's writer
        after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        if delta("tlaloc_structured_generations_total", model=reporter) >= 3:
            break
    kind = {"model": reporter, "kind": "json_schema"}
    assert delta("tlaloc_structured_generations_total", **kind) == 3
    # one compile (none if an earlier test compiled the schema), the rest from the cache
    assert delta("tlaloc_grammar_compiles_total", **kind) <= 1
    assert (delta("tlaloc_grammar_compiles_total", **kind)
            + delta("tlaloc_grammar_cache_hits_total", **kind)) == 3
    assert delta("tlaloc_grammar_mask_seconds_count", model=reporter) >= 3 * 10
    # the schema's keys and separators: forced, fed without the model choosing them
    assert delta("tlaloc_grammar_forced_tokens_total", model=reporter) >= 3 * 4


def test_greedy_structured_ids_are_the_served_logits_argmax_under_the_mask(served):
    """The constrained greedy ids through the generate model equal the argmax of the sequence
    model's own LOGITS, step by step over the client, under llguidance's mask for the same
    schema built from llguidance's API (checks/schemas.py; tests/test_smollm2.py holds the
    engine's constrained ids to transformers' logits). Negative control: that mask rolled by
    one id gives other ids."""
    server, tok = served
    prompt = tok.apply_chat_template(ASK_PERSON)
    got = generate(server.grpc_url, "smollm2_generate", input_ids=prompt,
                   sampling={"max_tokens": 80, "structured_output": {"json_schema": PERSON}})
    assert got.finish_reason == "stop"

    def constrained(shift: int) -> list[int]:
        with TlalocClient(server.grpc_url, "smollm2") as c:
            seq, started = new_sequence_id(), []

            def next_logits(ids: list[int]) -> np.ndarray:
                out = c.request(seq, ids, start=not started, outputs=("LOGITS",))
                started.append(True)
                return out["LOGITS"]
            try:
                return masked_greedy(next_logits, tok.tok.to_str(), 49152, tok.eos_token_id,
                                     prompt, 80, shift)
            finally:
                c.request(seq, [], end=True, outputs=())

    want = constrained(0)
    assert got.token_ids == want and len(want) > 10
    assert constrained(1) != got.token_ids


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
def test_a_constraint_that_cannot_compile_is_refused_by_name(served, loop):
    server, _ = served
    prompt = [1, 17, 99]
    for constraint, says in (({"regex": "[a-"}, "structured_output.regex"),
                             ({"json_schema": {"type": "strin"}}, "Invalid type: strin"),
                             ({"choice": []}, "structured_output.choice []"),
                             ({"grammar": 'root ::= "a'}, "structured_output.grammar"),
                             # past the parser's limits at its first step
                             ({"grammar": f"start: {TOO_MANY_ALTERNATIVES}\n"}, "max is 2000")):
        got = generate(server.grpc_url, f"smollm2_generate{loop}", input_ids=prompt,
                       sampling={"structured_output": constraint})
        assert got.status == "INVALID_ARGUMENT" and says in got.error, (constraint, got)
        assert got.responses == 1
    # past them after the model's first choice: the generation ends with the reason (the
    # token streamed before it, then the one error)
    got = generate(server.grpc_url, f"smollm2_generate{loop}", input_ids=prompt, sampling={
        "structured_output": {"grammar": f'start: ("a" | "b") x\nx: {TOO_MANY_ALTERNATIVES}\n'}})
    assert got.status == "INVALID_ARGUMENT" and "the grammar failed at this step" in got.error
    assert "max is 2000" in got.error and got.finish_reason == "error"
    # llama's tiny artifact has no tokenizer to constrain with
    got = generate(server.grpc_url, f"llama_generate{loop}", input_ids=PROMPT,
                   sampling={"structured_output": {"regex": "a"}})
    assert got.status == "INVALID_ARGUMENT" and "tokenizer" in got.error


@pytest.mark.parametrize("loop", ["", "_bls"], ids=["local loop", "BLS loop"])
def test_forced_tokens_count_against_max_tokens_and_a_grammar_without_end_ends_by_length(
        served, loop):
    """A regex whose answer is all forced (`Q{100}`) with max_tokens 1: one token, finish
    length, and the sequence model runs the prompt alone (the old START fed the prompt and
    all 100 forced tokens: a run of over 100 tokens, which the count tells apart). A grammar
    that never ends (`start: "ab" start`) ends by length at max_tokens, as in vLLM."""
    server, tok = served
    prompt = [1, 17, 99]
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    got = generate(server.grpc_url, f"smollm2_generate{loop}", input_ids=prompt,
                   sampling={"max_tokens": 1, "structured_output": {"regex": "Q{100}"}})
    assert got.error is None and got.finish_reason == "length", got
    assert got.completion_tokens == 1 and set(got.text) == {"Q"}
    for _ in range(20):  # applied every 250 ms by the model's writer
        after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        ran = (metric(after, "tlaloc_tokens_total", model="smollm2")
               - metric(before, "tlaloc_tokens_total", model="smollm2"))
        if ran:
            break
    assert 0 < ran <= len(prompt), ran
    got = generate(server.grpc_url, f"smollm2_generate{loop}", input_ids=prompt,
                   sampling={"max_tokens": 8, "structured_output": {
                       "grammar": 'start: "ab" start'}})
    assert got.error is None and got.finish_reason == "length", got
    assert got.completion_tokens == 8 and got.text.startswith("abab")


def test_penalties_give_the_same_ids_in_both_loops_and_through_openai(served, openai_url):
    """SmolLM2, greedy under every sampling control: the local loop and the BLS loop give the
    same ids, other than without them (the control), and `tlaloc openai` passes OpenAI's and
    vLLM's fields on (the same text); a logit_bias id outside the vocabulary is a 400."""
    import openai

    server, tok = served
    messages = [{"role": "user", "content": "List three colours."}]
    prompt = tok.apply_chat_template(messages)
    controls = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4,
                "logit_bias": {"28": 3.0}, "min_tokens": 6}
    sampling = {"max_tokens": 16, **controls}
    local = generate(server.grpc_url, "smollm2_generate", input_ids=prompt, sampling=sampling)
    bls = generate(server.grpc_url, "smollm2_generate_bls", input_ids=prompt,
                   sampling=sampling)
    plain = generate(server.grpc_url, "smollm2_generate", input_ids=prompt,
                     sampling={"max_tokens": 16})
    assert local.error is None and local.token_ids == bls.token_ids != plain.token_ids
    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    chat = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=16,
        frequency_penalty=0.5, presence_penalty=0.4, logit_bias={"28": 3},
        user="tester", extra_body={"repetition_penalty": 1.3, "min_tokens": 6})
    assert chat.choices[0].message.content == local.text
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.chat.completions.create(model="smollm2", messages=messages,
                                       logit_bias={"49152": 5})


def test_logprobs_are_transformers_log_softmax_in_both_loops_and_through_openai(
        served, openai_url, smollm2_transformers):
    """SmolLM2, greedy and sampled with logprobs 5: each token's log-probability and its top
    five are transformers' log-softmax over the raw logits at that position, within 1e-4
    (measured: 4e-5), in the local loop and the BLS loop; greedy's chosen token is the top one.
    Control: log-probabilities after the temperature (a wrong reading of OpenAI's) fail the
    same check. The same under speculation (drafts kept) and under a JSON schema (forced
    tokens, in both loops). Through the openai
    package, a chat's logprobs content has the same numbers, whole and streamed."""
    import openai
    import torch
    from checks.oracle import load_reference

    server, tok = served
    messages = [{"role": "user", "content": "Name a fruit."}]
    prompt = tok.apply_chat_template(messages)
    reference = load_reference(smollm2_transformers)

    def log_softmax_of(ids: list[int], temperature: float = 1.0,
                       prompt: list[int] = prompt) -> np.ndarray:
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:]
        z = logits.double().numpy() / temperature
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True)), float(logits.abs().max())

    def error(got, temperature: float = 1.0, prompt: list[int] = prompt
              ) -> tuple[float, float]:
        want, scale = log_softmax_of(got.token_ids, temperature, prompt)
        worst = 0.0
        for i, (token, (lp, top)) in enumerate(zip(got.token_ids, got.logprobs)):
            worst = max(worst, abs(lp - want[i, token]),
                        *(abs(v - want[i, t]) for t, v in top))
            fifth = np.sort(want[i])[-5]  # the top five (up to near ties)
            assert len(top) == 5 and all(want[i, t] >= fifth - 1e-3 for t, _ in top)
        return worst / max(1.0, scale), worst
    for model, sampling in (("smollm2_generate", {}),
                            ("smollm2_generate_bls", {}),
                            ("smollm2_generate", {"temperature": 0.7, "seed": 3})):
        got = generate(server.grpc_url, model, input_ids=prompt,
                       sampling={"max_tokens": 12, "ignore_eos": True, "logprobs": 5,
                                 **sampling})
        assert got.error is None and len(got.logprobs) == len(got.token_ids) == 12
        relative, absolute = error(got)
        print(f"{model} {sampling}: logprobs error {absolute:.2e} ({relative:.2e} relative)")
        assert absolute <= 1e-4
        if not sampling:
            assert all(token == top[0][0] for token, (_, top) in zip(got.token_ids, got.logprobs))
        else:
            assert error(got, 0.7)[1] > 1e-4  # the control
    # Tokens that come from verify calls (drafts kept, a grammar's forced tokens) have their
    # own positions' entries: speculation (its drafts counted) and a grammar, in the local loop
    edit = tok.apply_chat_template([{"role": "user", "content": EDIT}])
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    spec = generate(server.grpc_url, "smollm2_generate", input_ids=edit,
                    sampling={**speculative(4, adaptive=False), "logprobs": 5})
    assert spec.error is None and spec.token_ids == greedy(server, "smollm2", edit, 40)
    accepted = "tlaloc_accepted_draft_tokens_total"
    for _ in range(20):  # applied every 250 ms by the model's writer
        after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        if metric(after, accepted, model="smollm2") > metric(before, accepted, model="smollm2"):
            break
    assert metric(after, accepted, model="smollm2") > metric(before, accepted, model="smollm2")
    assert error(spec, prompt=edit)[1] <= 1e-4 and len(spec.logprobs) == 40
    fruit = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}},
             "required": ["fruit"], "additionalProperties": False}
    for model in ("smollm2_generate", "smollm2_generate_bls"):
        shaped = generate(server.grpc_url, model, input_ids=prompt,
                          sampling={"max_tokens": 24, "logprobs": 5,
                                    "structured_output": {"json_schema": fruit}})
        assert shaped.error is None and len(shaped.logprobs) == len(shaped.token_ids) > 4
        json.loads(shaped.text)
        print(f"{model} under a grammar: logprobs error {error(shaped)[1]:.2e}")
        assert error(shaped)[1] <= 1e-4
    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    chat = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                          max_tokens=12, logprobs=True, top_logprobs=5)
    want = generate(server.grpc_url, "smollm2_generate", input_ids=prompt,
                    sampling={"max_tokens": 12, "logprobs": 5})
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == [lp for lp, _ in want.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        [v for _, v in top] for _, top in want.logprobs]
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    streamed = [c for chunk in client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=12, logprobs=True,
        top_logprobs=5, stream=True) if chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs: 21"):
        client.chat.completions.create(model="smollm2", messages=messages, logprobs=True,
                                       top_logprobs=21)


def test_prompt_logprobs_are_transformers_through_echo_and_prompt_logprobs(
        served, openai_url, smollm2_transformers):
    """The prompt's own log-probabilities, through the openai package, against transformers'
    log-softmax at each prompt position within 1e-4: a completion with echo and logprobs
    (SmolLM2 with verify entries: the prompt fed up to 9 tokens a verify call) and a chat with
    prompt_logprobs (smollm2_chat has none: one token a decode step). Each prompt token's rank
    is transformers'; the generated text is the one without them. Control: the entries read one
    position late fail. The BLS loop refuses them by name."""
    import openai
    import torch
    from checks.oracle import load_reference

    server, tok = served
    reference = load_reference(smollm2_transformers)
    client = openai.OpenAI(base_url=openai_url, api_key="unused")

    def log_softmax(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            z = reference(torch.tensor([ids])).logits[0].double().numpy()
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    def check(ids: list[int], body: list, late: int = 0) -> float:
        """The worst error of vLLM-shaped prompt_logprobs `body` against the reference (read
        `late` positions late: the control), each prompt token's rank checked."""
        want, worst = log_softmax(ids), 0.0
        assert body[0] is None and len(body) == len(ids)
        for i, at in enumerate(body[1:len(ids) - late], 1):
            row = want[i - 1 + late]
            for token, v in at.items():
                worst = max(worst, abs(v["logprob"] - row[int(token)]))
            w, rank = row[ids[i]], at[str(ids[i])]["rank"]
            assert late or 1 + np.sum(row > w + 1e-3) <= rank <= 1 + np.sum(row > w - 1e-3)
        return worst

    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
            "begins with a single step, and the capital of France is")
    ids = tok.encode(text)
    assert len(ids) > 2 * 9  # several verify calls
    got = client.completions.create(model="smollm2", prompt=text, echo=True, logprobs=2,
                                    max_tokens=6, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    plain = client.completions.create(model="smollm2", prompt=text, max_tokens=6,
                                      temperature=0)
    choice = got.choices[0]
    assert choice.text == text + plain.choices[0].text
    body = choice.model_extra["prompt_logprobs"]
    worst = check(ids, body)
    print(f"prompt logprobs, verify calls: error {worst:.2e}")
    assert worst <= 1e-4
    assert check(ids, body, late=1) > 0.1  # the control
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 6
    assert lp.token_logprobs[1:len(ids)] == [body[i][str(ids[i])]["logprob"]
                                             for i in range(1, len(ids))]
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    chat_ids = tok.apply_chat_template(messages)
    chat = client.chat.completions.create(model="smollm2_chat", messages=messages,
                                          max_tokens=4, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    worst = check(chat_ids, chat.model_extra["prompt_logprobs"])
    print(f"prompt logprobs, decode steps: error {worst:.2e}")
    assert worst <= 1e-4
    bls = generate(server.grpc_url, "smollm2_generate_bls", input_ids=ids,
                   sampling={"max_tokens": 2, "prompt_logprobs": 0})
    assert bls.status == "INVALID_ARGUMENT" and "prompt_logprobs" in bls.error


def test_n_choices_share_the_prompts_computation(served, openai_url):
    """Through the openai package: n=2 greedy gives two choices equal to n=1's; n=4 sampled
    (seeded) gives four from one prefill call: choice 0 starts first, the other three once it
    has its first token, sharing its prompt's full blocks and copying its open block (the
    sequence model's metrics: one prefill execution, the prompt's tokens prefilled at most
    once)."""
    import openai

    server, tok = served
    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    question = [{"role": "user", "content": "Say something about the sea."}]
    one = client.chat.completions.create(model="smollm2_chat", messages=question,
                                         temperature=0, max_tokens=8)
    two = client.chat.completions.create(model="smollm2_chat", messages=question,
                                         temperature=0, max_tokens=8, n=2)
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    long = [{"role": "user", "content": " ".join(
        f"Line {i}: the tide rose over stone number {i * 7} near the harbour." for i in range(12))
        + " Write one sentence about it."}]
    prompt = len(tok.apply_chat_template(long))
    before = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    four = client.chat.completions.create(model="smollm2_chat", messages=long, temperature=1.0,
                                          seed=7, max_tokens=8, n=4)
    assert sorted(c.index for c in four.choices) == [0, 1, 2, 3]
    assert len({c.message.content for c in four.choices}) > 1  # their own seeds
    assert four.usage.prompt_tokens == prompt
    def delta(name: str) -> float:
        return (metric(after, name, model="smollm2_chat", kind="prefill")
                - metric(before, name, model="smollm2_chat", kind="prefill"))
    for _ in range(20):  # applied every 250 ms by the model's writer
        after = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
        if delta("tlaloc_tokens_total") >= prompt - 32:
            break
    prefill, calls = delta("tlaloc_tokens_total"), delta("tlaloc_executions_total")
    print(f"n=4: {prefill:.0f} prefill tokens in {calls:.0f} calls for a prompt of {prompt}")
    assert calls == 1 and prompt - 32 <= prefill <= prompt  # (its system prompt may be cached)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    """A streamed chat's tool calls as a client joins them from the deltas (name, arguments by
    index), and its finish reason."""
    calls, finish = {}, None
    for chunk in chunks:
        for c in chunk.choices[0].delta.tool_calls or []:
            have = calls.setdefault(c.index, ["", ""])
            have[0] += c.function.name or ""
            have[1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_required_and_named_tool_calls_validate_and_stream_as_they_answer(openai_url):
    """SmolLM2 (its template has no tools: hermes' format goes in its prompt) through the
    openai package: tool_choice required and a named function give calls whose arguments
    validate against the function's schema, finish_reason tool_calls; streamed, the deltas
    (the name first, then argument pieces) join to the same call; after the tool's result the
    model answers in text."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        got = client.chat.completions.create(model="smollm2_chat", messages=messages, tools=tools,
                                             tool_choice=choice, temperature=0, max_tokens=60)
        answer = got.choices[0]
        assert answer.finish_reason == "tool_calls", answer
        assert answer.message.content is None and answer.message.tool_calls
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice != "required":
            assert [c.function.name for c in answer.message.tool_calls] == ["get_weather"]
        calls, finish = streamed_calls(client.chat.completions.create(
            model="smollm2_chat", messages=messages, tools=tools, tool_choice=choice,
            temperature=0, max_tokens=60, stream=True))
        assert finish == "tool_calls"
        assert calls == [(c.function.name, c.function.arguments)
                         for c in answer.message.tool_calls]
    call = answer.message.tool_calls[0]
    after = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    reply = client.chat.completions.create(model="smollm2_chat", messages=after, tools=tools,
                                           tool_choice="none", temperature=0, max_tokens=30)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name"):
        client.chat.completions.create(model="smollm2_chat", messages=messages, tools=[TIME_TOOL],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}})


def test_auto_reads_the_tool_call_and_the_thinking_the_model_wrote(served, openai_url):
    """A tiny qwen3 taught a hermes tool call and a <think> block (checks/taught_model.py),
    through the openai package with both parsers auto (read from its chat template): its
    greedy text under tool_choice auto (the raw text through /v1/completions: the call as the
    model wrote it) comes back as message.tool_calls, finish_reason tool_calls, the streamed
    deltas joining to the same call; its thinking comes back as reasoning_content, the rest as
    content, streamed alike. Control: with tool_choice none nothing is parsed."""
    import openai
    from checks.taught_model import CALL, THOUGHT

    server, _ = served
    tok = ArtifactTokenizer(served_tokenizer_dir(server, "taught"))
    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    messages, tools, answer = CALL
    raw = client.completions.create(model="taught", temperature=0, max_tokens=80,
                                    prompt=tok.apply_chat_template(messages, tools=tools))
    assert raw.choices[0].text == answer  # what the model writes
    got = client.chat.completions.create(model="taught", messages=messages, tools=tools,
                                         temperature=0, max_tokens=80)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    calls, finish = streamed_calls(client.chat.completions.create(
        model="taught", messages=messages, tools=tools, temperature=0, max_tokens=80,
        stream=True))
    assert finish == "tool_calls"
    assert calls == [("get_weather", call.function.arguments)]
    unparsed = client.chat.completions.create(model="taught", messages=messages, tools=tools,
                                              tool_choice="none", temperature=0, max_tokens=80)
    assert unparsed.choices[0].message.content == answer  # the control
    assert not unparsed.choices[0].message.tool_calls
    messages, _, answer = THOUGHT
    thought = client.chat.completions.create(model="taught", messages=messages, temperature=0,
                                             max_tokens=60).choices[0]
    assert thought.message.model_extra["reasoning_content"].strip() == "A greeting."
    assert thought.message.content.strip() == "Hello there!"
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model="taught", messages=messages,
                                                temperature=0, max_tokens=60, stream=True):
        delta = chunk.choices[0].delta
        parts["content"] += delta.content or ""
        parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": thought.message.model_extra["reasoning_content"],
                     "content": thought.message.content}


def served_tokenizer_dir(server, name: str) -> str:
    """The tokenizer directory NAME's generate model names in its parameters."""
    from triton_tlaloc.repository import generate_model_name

    with TlalocClient(server.grpc_url, generate_model_name(name), "grpc") as c:
        return c.model_parameters()["tokenizer_dir"]


def test_the_openai_response_format_gives_json_that_validates(served, openai_url):
    """response_format json_schema (streamed and not) and json_object through the openai
    package; vLLM's guided_json alike; a bad schema and two constraints at once are 400s."""
    import openai

    client = openai.OpenAI(base_url=openai_url, api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    chat = client.chat.completions.create(model="smollm2", messages=ASK_PERSON, temperature=0,
                                          max_tokens=80, response_format=fmt)
    assert chat.choices[0].finish_reason == "stop"
    answer = validated(chat.choices[0].message.content)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=ASK_PERSON, temperature=0, max_tokens=80,
        response_format=fmt, stream=True))
    assert validated("".join(c.choices[0].delta.content or "" for c in chunks)) == answer
    guided = client.chat.completions.create(model="smollm2", messages=ASK_PERSON,
                                            temperature=0, max_tokens=80,
                                            extra_body={"guided_json": PERSON})
    assert validated(guided.choices[0].message.content) == answer
    anything = client.completions.create(model="smollm2", prompt="A JSON object: ",
                                         max_tokens=60, temperature=0, seed=1,
                                         extra_body={"response_format": {"type": "json_object"}})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert anything.choices[0].text.startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError, match="Invalid type: strin"):
        client.chat.completions.create(model="smollm2", messages=ASK_PERSON, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="at most one constraint"):
        client.chat.completions.create(model="smollm2", messages=ASK_PERSON, response_format=fmt,
                                       extra_body={"guided_regex": "a+"})
    with pytest.raises(openai.BadRequestError, match="response_format.type"):
        client.chat.completions.create(model="smollm2", messages=ASK_PERSON,
                                       response_format={"type": "yaml"})


def test_speculation_under_a_grammar_keeps_the_constrained_greedy_ids(served):
    """Prompt lookup under a JSON schema through the local loop: the drafts the grammar
    refuses are cut, those that stand are allowed, so the greedy ids are the constrained ids
    without speculation, and the answer validates."""
    server, tok = served
    example = '{"name":"Ada","age":36,"city":"Paris","pets":[{"kind":"cat","legs":4}]}'
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Like {example}, invent a "
                                                                  f"person. Answer in JSON."}])
    sampling = {"max_tokens": 80, "structured_output": {"json_schema": PERSON}}
    plain = generate(server.grpc_url, "smollm2_generate", input_ids=prompt, sampling=sampling)
    drafted = generate(server.grpc_url, "smollm2_generate", input_ids=prompt, sampling={
        **sampling, "speculative": {"method": "prompt_lookup", "num_draft_tokens": 4}})
    assert plain.finish_reason == drafted.finish_reason == "stop"
    assert drafted.token_ids == plain.token_ids
    validated(drafted.text)


def test_tlaloc_generate_and_the_client_take_a_constraint(served, tmp_path, capsys):
    """`tlaloc generate --choice` and `--json-schema FILE` answer through NAME_generate under
    the constraint; TlalocClient.generate(structured_output=) over HTTP alike; a bad regex
    is the server's refusal, exit status 1."""
    from triton_tlaloc.cli import main

    server, tok = served
    base = ["generate", "--url", server.grpc_url, "--model", "smollm2", "--chat", "--prompt",
            "Is the sky blue? Answer yes or no.", "--max-new-tokens", "8"]
    assert main(base + ["--choice", "yes,no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert main(base[:-1] + ["80", "--json-schema", str(schema), "--json"]) == 0
    validated(json.loads(capsys.readouterr().out)["text"])
    assert main(base + ["--regex", "[a-"]) == 1
    assert "structured_output.regex" in capsys.readouterr().err
    with TlalocClient(server.http_url, "smollm2", "http") as client:
        got = client.generate(tok.apply_chat_template(ASK_PERSON), {"max_tokens": 80},
                              structured_output={"json_schema": PERSON})
    assert got.finish_reason == "stop"
    validated(got.text)

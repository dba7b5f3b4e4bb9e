"""`vllm serve` on an artifact (vLLM's OpenAI server started as `python -m
vllm.entrypoints.openai.api_server`, VLLM_PLUGINS=tlaloc) answering the `openai` package: a chat,
streamed and whole, with transformers' greedy text for the prompt ids vLLM rendered, and the
text `tlaloc openai` answers for the same artifact (tritonserver and the front end run by make
test's environment: checks/tlaloc_openai_chat.py); seeded sampling repeating, greedy logprobs,
bad words avoided, prompt logprobs, structured outputs following their grammar; a bad value a
400 naming it, and the server goes on answering."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# (vllm.entrypoints: where vLLM is absent, this folder is found as a namespace package "vllm")
pytest.importorskip("vllm.entrypoints",
                    reason="the vLLM lane: make test-vllm runs these in .venv-vllm")

from checks.oracle import load_reference, reference_greedy  # noqa: E402
from vllm_lane import EXPORTER, ROOT, exported_fixture, smollm2_sources  # noqa: E402

exported = pytest.fixture(scope="session")(exported_fixture)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(exported, run_dir, tmp_path_factory):
    gguf, hf = smollm2_sources(run_dir)
    art = exported(gguf, "smollm2")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    env = {**os.environ, "VLLM_PLUGINS": "tlaloc"}
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(art),
             "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
             "--block-size", "16", "--max-model-len", "256", "--dtype", "float32"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"vllm serve did not start: {log.read_text()[-4000:]}")
                time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1", hf, art
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def test_a_chat_streamed_and_whole_has_transformers_greedy_text(served):
    import openai
    from transformers import AutoTokenizer

    url, hf, art = served
    client = openai.OpenAI(base_url=url, api_key="unused")
    whole = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0,
                                           max_tokens=24, extra_body={"return_token_ids": True})
    prompt_ids = whole.prompt_token_ids
    tok = AutoTokenizer.from_pretrained(hf)
    ids, _ = reference_greedy(load_reference(hf), prompt_ids, 24)
    if tok.eos_token_id in ids:  # the answer ends where the model ends its turn
        ids = ids[:ids.index(tok.eos_token_id)]
    want = tok.decode(ids, skip_special_tokens=True)
    assert whole.choices[0].message.content == want
    assert "Paris" in want
    pieces = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0,
                                            max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want
    # tlaloc openai on the same artifact, through tritonserver
    run = subprocess.run([str(EXPORTER), "-m", "checks.tlaloc_openai_chat", str(art),
                          json.dumps(CHAT), "24"], capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    assert theirs == {"text": want, "streamed": want}


def test_sampling_logprobs_prompt_logprobs_and_bad_words_are_served(served):
    import openai

    url, _, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused")
    seeded = [client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12,
                                             temperature=0.9, top_p=0.95, seed=s)
              .choices[0].message.content for s in (3, 3, 4)]
    assert seeded[0] == seeded[1] and seeded[0]  # (another seed: most likely another answer)
    print("seeded answers:", seeded)
    lp = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in content)
    assert all(t.logprob == max(x.logprob for x in t.top_logprobs) for t in content)  # greedy
    # bad words (vLLM tokenizes them): greedy goes around them
    plain = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12,
                                           temperature=0).choices[0].message.content
    banned = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=12, temperature=0,
        extra_body={"bad_words": ["Paris"]}).choices[0].message.content
    assert "Paris" in plain and "Paris" not in banned, (plain, banned)
    # the prompt's own logprobs (the artifact has verify entries): one a prompt token, the
    # first None, each a log-probability with its rank
    scored = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=4, temperature=0,
        extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    prompt_lp = scored.model_extra["prompt_logprobs"]
    assert len(prompt_lp) == len(scored.prompt_token_ids) and prompt_lp[0] is None
    assert all(lp and all(v["logprob"] <= 0.0 for v in lp.values()) for lp in prompt_lp[1:])
    # min_p beyond its range: vLLM's own 400, the server going on
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4,
                                       extra_body={"min_p": 2.0})
    ok = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0,
                                        max_tokens=4)
    assert ok.choices[0].message.content


def test_structured_outputs_follow_their_grammar_and_the_plain_answer_does_not(served):
    """vLLM's grammar (xgrammar) masks the rows of its structured-output requests before the
    worker's sampler: a JSON schema's answer parses and validates, a choice's is one of the
    choices, greedy and seeded-sampled; control: the same chat unconstrained is neither."""
    import jsonschema
    import openai

    url, _, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"enum": ["France", "Italy", "Spain"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    choices = ["Paris", "London", "Rome"]
    for temperature in (0.0, 0.8):
        answer = client.chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=60, temperature=temperature, seed=5,
            response_format=fmt).choices[0]
        assert answer.finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.message.content), schema)
        chosen = client.chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=8, temperature=temperature, seed=5,
            extra_body={"structured_outputs": {"choice": choices}}).choices[0].message.content
        assert chosen in choices, chosen
    plain = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=60,
                                           temperature=0).choices[0].message.content
    assert plain not in choices
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)

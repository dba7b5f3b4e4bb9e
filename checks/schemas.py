"""Structured output's test material: a JSON schema held out from the unit tests'
(tests/unit/test_structured.py), the chat that asks for it, the oracle of greedy ids under a
schema, small byte-level BPE tokenizers trained in milliseconds (for models with no tokenizer
of their own), and generations run through a real batcher in process. Checked on SmolLM2
(tests/test_generate.py, tests/test_smollm2.py) and on a tiny model of every family
(tests/test_structured_families.py). PERSON's strings, numbers and arrays are bounded, so
every answer under it ends within 80 of SmolLM2's tokens."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

PERSON = {  # enums, bounds, nested objects, a pattern, no extra properties
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "job": {"enum": ["baker", "pilot", "nurse", "teacher"]},
        "skills": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object",
            "properties": {"skill": {"enum": ["cooking", "flying", "singing"]},
                           "level": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["skill", "level"], "additionalProperties": False}},
    },
    "required": ["name", "age", "job", "skills"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Invent a person. Answer in JSON."}]
# A Lark rule of 2001 alternatives: one more than llguidance lets an Earley row hold
# (generation/grammar.py's PARSER_LIMITS), a limit compiling does not see
TOO_MANY_ALTERNATIVES = " | ".join(f'"w{i}"' for i in range(2001))


def masked_greedy(next_logits: Callable[[list[int]], np.ndarray], tokenizer_json: str,
                  vocab: int, eos: int, prompt: list[int], steps: int,
                  shift: int = 0, schema: dict = PERSON) -> list[int]:
    """The oracle: greedy ids under llguidance's mask for `schema`, built from llguidance's API
    (not the project's), the end id allowed exactly when the grammar accepts, and the tokens
    the grammar forces (llguidance's fast-forward tokens) taken as they are, whatever the
    logits say; once the grammar takes nothing more, the answer ends.
    `next_logits(ids)` feeds ids to a model (the prompt first, then what came next) and gives
    the logits that follow. `shift` rolls the mask by that many ids (the negative control);
    a token the grammar then refuses ends the ids with -1."""
    import llguidance
    import llguidance.numpy as llnp

    matcher = llguidance.LLMatcher(
        llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab),
        llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}))
    bits = llnp.allocate_token_bitmask(1, vocab)
    ids, feed = [], list(prompt)
    for _ in range(steps):
        forced = matcher.compute_ff_tokens()
        matcher.consume_tokens(forced)
        ids, feed = ids + forced, feed + forced
        if matcher.is_stopped():
            return ids
        logits = np.asarray(next_logits(feed), np.float32).reshape(-1)
        llnp.fill_next_token_bitmask(matcher, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        allowed[eos] = matcher.is_accepting()
        token = int(np.argmax(np.where(np.roll(allowed, shift), logits, -np.inf)))
        if token == eos:
            return ids
        ids.append(token)
        if not matcher.consume_token(token):
            return ids + [-1]  # refused by the grammar: only a rolled mask gets here
        feed = [token]
    return ids


def _byte_chars() -> dict[int, str]:
    """GPT-2's map of bytes to the characters a byte-level BPE writes them as."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def byte_level_bpe(vocab_size: int, specials: list[str], *, ascii_only: bool = False):
    """A byte-level BPE (a `tokenizers.Tokenizer`) trained on JSON and prose, the special
    tokens first (their ids 0, 1, ...). `ascii_only` keeps its alphabet to printable ASCII and
    newline, so that it fits a vocabulary of 256 ids with room for merges (the tiny models')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if ascii_only:
        chars = _byte_chars()
        alphabet = [chars[b] for b in (*range(32, 127), 10)]
    else:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    corpus = ['{"name":"Ada","age":36,"city":"Paris","pets":[{"kind":"cat","legs":4}]}',
              '{"name":"Bo","age":51,"job":"pilot","skills":[{"skill":"flying","level":3}]}',
              "yes no maybe 0123456789 true false null",
              "The quick brown fox jumps over the lazy dog."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=alphabet, limit_alphabet=len(alphabet)))
    return tok


def generate_batched(engine, grammars, specs: list, eos: int) -> list[list[int]]:
    """Generations (each a prompt and its SamplingParams) started together through a real
    batcher over `engine`, the way the sequence model runs them: the ids each emitted."""
    from triton_tlaloc.batcher import Batcher
    from triton_tlaloc.generation.local_generation import Generation, Speculation
    from triton_tlaloc.scheduling.policy import BatchPolicy

    batcher = Batcher(engine, BatchPolicy(prefill_wait_s=0.001))
    nexts, events = [], []

    def round_ended():
        if nexts:
            batcher.submit_group(nexts[:])
            nexts.clear()
    batcher.round_listeners.append(round_ended)
    speculation = Speculation.of(batcher.engine)
    gens = [Generation(i, prompt, params, set() if params.ignore_eos else {eos},
                       engine.art.max_context, events.append, nexts.extend, speculation,
                       grammars=grammars)
            for i, (prompt, params) in enumerate(specs)]
    batcher.start()
    try:
        batcher.submit_group([g.start_request() for g in gens])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(g.finished for g in gens) and not batcher.sequences:
                break
            time.sleep(0.005)
    finally:
        batcher.stop()
    assert all(g.finished for g in gens)
    return [[e[1] for e in events if e[0] == i and e[1] >= 0] for i in range(len(specs))]

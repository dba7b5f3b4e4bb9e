"""A JSON schema held out from the unit tests' (tests/unit/test_structured.py), the chat that
asks for it, and the oracle of greedy ids under it: structured output checked on SmolLM2
(tests/test_generate.py, tests/test_smollm2.py). Its strings, numbers and arrays are bounded,
so every answer under it ends within 80 tokens."""

from __future__ import annotations

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


def masked_greedy(next_logits: Callable[[list[int]], np.ndarray], tokenizer_json: str,
                  vocab: int, eos: int, prompt: list[int], steps: int,
                  shift: int = 0) -> list[int]:
    """The oracle: greedy ids under llguidance's mask for PERSON, built from llguidance's API
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
            PERSON, overrides={"whitespace_flexible": False}))
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

"""Structured output on a tiny model of every family the exporter takes (no server): a
generation under a JSON schema and a free one, started together through a real batcher with the
grammar engine (as the sequence model runs them, forced tokens in verify calls where the model
has them), give transformers' ids: the constrained one the argmax over transformers' logits
under llguidance's mask (checks/schemas.masked_greedy), token for token, the free one
transformers' greedy ids. The tiny models have no tokenizer of their own: a byte-level BPE of
printable ASCII is trained for them (their ids 0-2 are its <unk>, <bos>, <eos>). The control:
the oracle's mask shifted by one id gives other ids."""

from __future__ import annotations

import json

import jsonschema
import pytest
from checks.oracle import incremental_logits, load_reference, make_tiny_checkpoint, reference_greedy
from checks.schemas import PERSON, byte_level_bpe, generate_batched, masked_greedy

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.export.config import FAMILIES
from triton_tlaloc.generation.sampling import SamplingParams
from triton_tlaloc.generation.grammar import Grammars
from triton_tlaloc.runtime.core import Runtime

EOS = 2  # the tiny models' eos_token_id
STEPS = 120  # more than any answer under PERSON takes in this tokenizer
OPTS = dict(batch_ladder=(1, 2), context_ladder=(192,), block_size=8, verify_tokens=(5, 9))
# The windowed families (window 8): pages of 4, prefill calls of 8, as their other tests.
WINDOW_OPTS = dict(OPTS, block_size=4, prefill_chunk=8, attention_block=16)
FREE_PROMPT = [1, 17, 99, 3, 200, 41, 7, 88]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe(256, ["<unk>", "<bos>", "<eos>"], ascii_only=True)


# The dense families (a mixture's verify calls and decode rows: tests/test_moe.py)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("qwen3_moe", "mixtral",
                                                                     "qwen3_5_moe_text")])
def test_constrained_greedy_ids_equal_transformers_under_the_same_mask(family, tokenizer, work):
    windowed = family in ("mistral", "gemma3_text")
    ckpt = make_tiny_checkpoint(work / f"ckpt-structured-{family}", family,
                                tied=family in ("qwen3", "gemma3_text"), seed=5 if windowed else 0)
    (ckpt / "tokenizer.json").write_text(tokenizer.to_str())
    art = export_artifact(ckpt, work / f"art-structured-{family}",
                          ExportOptions(**(WINDOW_OPTS if windowed else OPTS)))
    engine = Engine(Runtime(art))
    grammars = Grammars(art / "tokenizer", engine.art.model.vocab, [EOS])
    prompt = [1] + tokenizer.encode("Invent a person. Answer in JSON.").ids
    constrained = SamplingParams.from_dict({"max_tokens": STEPS,
                                            "structured_output": {"json_schema": PERSON}})
    free = SamplingParams(max_tokens=20, ignore_eos=True)
    try:
        ids, free_ids = generate_batched(engine, grammars, [(prompt, constrained),
                                                            (FREE_PROMPT, free)], EOS)
    finally:
        grammars.close()
    jsonschema.validate(json.loads(tokenizer.decode(ids)), PERSON)

    reference = load_reference(ckpt)
    tokenizer_json = tokenizer.to_str()

    def oracle(shift: int) -> list[int]:
        return masked_greedy(incremental_logits(reference), tokenizer_json,
                             engine.art.model.vocab, EOS, prompt, STEPS, shift)
    want = oracle(0)
    print(f"{family}: {len(ids)} ids under the schema; {engine.executions} calls")
    assert ids == want and len(want) > 20
    assert oracle(1) != ids
    assert free_ids == reference_greedy(reference, FREE_PROMPT, 20)[0]

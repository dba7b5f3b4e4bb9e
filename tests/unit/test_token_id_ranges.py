"""Token ids a client sends to `tlaloc openai` are checked against the tokenizer's vocabulary,
each refusal a 400 naming the id and what is wrong with it (negative, or past the vocabulary
of so many tokens): a completion's prompt ids, stop_token_ids (vLLM's extension, passed on to
the generate model, which checks them against the model's vocabulary too) and /detokenize's
ids, which the tokenizer would otherwise decode as nothing."""

from __future__ import annotations

import pytest
from test_openai_doors import FakeTokenizer

from triton_tlaloc.frontends.http_doors import APIError
from triton_tlaloc.frontends.openai_requests import ServedModel, chat_call, completion_call
from triton_tlaloc.frontends.openai_utility import detokenized
from triton_tlaloc.generation.penalties import check_token_ids
from triton_tlaloc.generation.sampling import SamplingError, SamplingParams

VOCAB = 49152  # SmolLM2's


class SizedTokenizer(FakeTokenizer):
    vocab_size = VOCAB

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + t % 26) for t in ids)


MODELS = {"m": ServedModel("m", "m_generate", SizedTokenizer(), 100)}
UNSIZED = {"m": ServedModel("m", "m_generate", FakeTokenizer(), 100)}


def refusal(call, *args) -> str:
    with pytest.raises(APIError) as e:
        call(*args)
    assert e.value.status == 400
    return e.value.message


@pytest.mark.parametrize("ids, named", [
    ([-1, 5], "prompt: token id -1 (at 0) is negative: ids run from 0 to 49151"),
    ([5, VOCAB], "prompt: token id 49152 (at 1) is past the vocabulary of 49152 tokens "
                 "(ids 0 to 49151)"),
])
def test_prompt_ids_outside_the_vocabulary_are_refused_by_name(ids, named):
    assert refusal(completion_call, MODELS, {"model": "m", "prompt": ids}) == named


def test_prompt_ids_inside_the_vocabulary_pass():
    assert completion_call(MODELS, {"model": "m", "prompt": [0, VOCAB - 1]}).prompt_ids == [
        0, VOCAB - 1]
    # Control: the bound is the vocabulary's: a tokenizer that states none takes 49152
    assert completion_call(UNSIZED, {"model": "m", "prompt": [VOCAB]}).prompt_ids == [VOCAB]


@pytest.mark.parametrize("stop_ids, named", [
    ([1e9, -1], "stop_token_ids: token id 1000000000 (at 0) is past the vocabulary of 49152 "
                "tokens (ids 0 to 49151)"),
    ([7, -1], "stop_token_ids: token id -1 (at 1) is negative: ids run from 0 to 49151"),
    ([7.5], "stop_token_ids: a list of token ids, not [7.5]"),
    ("7", 'stop_token_ids: a list of token ids, not "7"'),
])
def test_stop_token_ids_outside_the_vocabulary_are_refused_by_name(stop_ids, named):
    for call, body in ((completion_call, {"model": "m", "prompt": "hi"}),
                       (chat_call, {"model": "m", "messages": [{"role": "user",
                                                                "content": "hi"}]})):
        assert refusal(call, MODELS, {**body, "stop_token_ids": stop_ids}) == named


def test_stop_token_ids_inside_the_vocabulary_go_to_the_generate_model():
    call = completion_call(MODELS, {"model": "m", "prompt": "hi", "stop_token_ids": [2, 3.0]})
    assert call.sampling["stop_token_ids"] == [2, 3]
    # (control: left out, none is sent)
    assert "stop_token_ids" not in completion_call(MODELS, {"model": "m", "prompt": "hi"}).sampling


def test_the_generate_model_checks_stop_token_ids_against_the_model_s_vocabulary():
    params = SamplingParams.from_dict({"stop_token_ids": [7, VOCAB]})
    with pytest.raises(SamplingError, match="stop_token_ids: token id 49152 is outside the "
                                            "vocabulary of 49152 tokens"):
        check_token_ids(params, VOCAB)
    check_token_ids(params, VOCAB + 1)  # control: inside a larger one


@pytest.mark.parametrize("ids, named", [
    ([VOCAB], "tokens: token id 49152 (at 0) is past the vocabulary of 49152 tokens "
              "(ids 0 to 49151)"),
    ([3, -2], "tokens: token id -2 (at 1) is negative: ids run from 0 to 49151"),
])
def test_detokenizing_an_id_outside_the_vocabulary_is_refused_by_name(ids, named):
    assert refusal(detokenized, MODELS, {"model": "m", "tokens": ids}, 1000) == named
    assert detokenized(MODELS, {"model": "m", "tokens": [0, 1]}, 1000) == {"prompt": "AB"}

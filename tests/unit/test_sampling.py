"""Sampling parameters, the sampler and the text stream of the generate model."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from checks.sampling_reference import (logit_rows, reference_choice, reference_probs,
                                       stable_nucleus)

from triton_tlaloc.generation.sampling import (MAX_STOP_CHARS, MAX_STOP_STRINGS, Sampler,
                                               SamplingError, SamplingParams, StopMatcher,
                                               TextStream, nucleus)


def test_sampling_parameters_are_checked_by_name():
    assert SamplingParams.from_dict({}).greedy
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0.7, "top_k": 3, "top_p": 0.9,
                                  "seed": 1, "stop": ".", "ignore_eos": True})
    assert (p.max_tokens, p.top_k, p.stop, p.ignore_eos) == (5, 3, (".",), True)
    for bad, message in (({"temperature": -1}, "temperature -1.0: must be >= 0"),
                         ({"top_p": 0}, "top_p 0.0: must be in (0, 1]"),
                         ({"max_tokens": 0}, "max_tokens 0: must be >= 1"),
                         ({"max_tokens": "5"}, "max_tokens '5': expected a number"),
                         ({"beam_width": 2}, "unknown sampling parameter(s) beam_width")):
        with pytest.raises(SamplingError, match=message.replace("(", r"\(").replace(")", r"\)")):
            SamplingParams.from_dict(bad)


def test_sampler_greedy_top_k_top_p_and_seed():
    logits = np.array([0.0, 3.0, 2.9, -1.0, 1.0], np.float32)
    assert Sampler(SamplingParams()).choose(logits) == 1
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s)).choose(logits) for s in range(200)]
    assert set(draws) == {0, 1, 2, 3, 4}  # every token can be drawn
    top2 = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s)).choose(logits)
            for s in range(200)}
    assert top2 == {1, 2}
    # top_p 0.5: token 1 alone holds less than half the mass, 1 and 2 together more
    top_p = {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s)).choose(logits)
             for s in range(200)}
    assert top_p == {1, 2}
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [a.choose(logits) for _ in range(50)] == [b.choose(logits) for _ in range(50)]


def agreement(params: SamplingParams, reference_params: SamplingParams, rows) -> float:
    """The share of draws in which the sampler and the reference (the same seed, so the same
    uniform number) choose the same token."""
    same = total = 0
    for seed, logits in enumerate(rows):
        sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        rng = np.random.default_rng(seed)
        probs = reference_probs(logits, reference_params)  # sorting 49,152 once, not a draw
        for _ in range(4):
            same += sampler.choose(logits) == reference_choice(probs, rng)
            total += 1
    return same / total


@pytest.mark.parametrize("settings", [dict(temperature=0.8), dict(temperature=1.0, top_k=40),
                                      dict(temperature=0.7, top_p=0.9),
                                      dict(temperature=1.3, top_k=200, top_p=0.5),
                                      dict(temperature=1.0, top_k=3)])
def test_the_sampler_draws_what_sampling_by_the_book_draws(settings):
    rows = logit_rows(40)
    params = SamplingParams(**settings)
    assert agreement(params, params, rows) >= 0.99  # equal but for rounding at a boundary
    # The control: a temperature a quarter higher is told apart.
    hotter = SamplingParams(**{**settings, "temperature": settings["temperature"] * 1.25})
    assert agreement(params, hotter, rows) < 0.95


def test_text_stream_holds_back_partial_characters_and_cuts_at_stop_strings():
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld.", 5: " More"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), stop=("d.",))
    assert [stream.push(i) for i in (1, 2, 3)] == ["Hel", "lo", " wor"]
    assert stream.push(4) == "l" and stream.stopped  # "Hello worl": cut before "d."
    assert stream.flush() == ""
    # a stop string's first characters are held back until they are known not to start it
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), stop=("ld!",))
    assert [stream.push(i) for i in (1, 2, 3, 4)] == ["He", "llo", " wor", "ld."]  # "l" waits
    # a byte-level tokenizer's half character (U+FFFD) is held back until it is whole
    stream = TextStream(lambda ids: "a" + ("é" if 3 in ids else "\ufffd" if 2 in ids else ""))
    assert [stream.push(1), stream.push(2), stream.push(3)] == ["a", "", "é"]
    assert stream.flush() == ""


def utf8_bytes(ids: list[int]) -> str:
    """A byte-level tokenizer's decode: each id one byte, an incomplete character U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_a_character_cut_by_the_end_of_the_generation_is_dropped_not_replaced(char):
    ids = list(("ok " + char).encode())
    for cut in range(len(ids) - len(char.encode()) + 1, len(ids)):  # inside the character
        stream = TextStream(utf8_bytes)
        text = "".join(stream.push(i) for i in ids[:cut]) + stream.flush()
        assert text == "ok ", (char, cut)
    stream = TextStream(utf8_bytes)  # the whole character: kept
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "ok " + char
    # a held back stop string's start is still given at the end, without the cut character
    stream = TextStream(utf8_bytes, stop=("k!",))
    pieces = [stream.push(i) for i in list("ok".encode()) + list(char.encode())[:-1]]
    assert "".join(pieces) + stream.flush() == "ok"


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad, message", [
    ({"temperature": NAN}, "temperature nan: must be a finite number"),
    ({"temperature": INF}, "temperature inf: must be a finite number"),
    ({"temperature": 10**400}, "temperature 1000"),  # beyond any float
    ({"top_p": -INF}, "top_p -inf: must be a finite number"),
    ({"top_p": NAN}, "top_p nan"),
    ({"temperature": True}, "temperature True: expected a number"),
    ({"temperature": []}, "temperature []: expected a number"),
    ({"temperature": {}}, "temperature {}: expected a number"),
    ({"temperature": "0.7"}, "temperature '0.7': expected a number"),
    ({"temperature": 1e-320}, "temperature 1e-320: must be 0 (greedy) or at least 1e-05"),
    ({"temperature": 9e-6}, "temperature 9e-06: must be 0 (greedy) or at least 1e-05"),
    ({"seed": -1}, "seed -1: must be an integer in [0, 2**64)"),
    ({"seed": 2**64}, "seed 18446744073709551616: must be an integer in [0, 2**64)"),
    ({"seed": 1.5}, "seed 1.5: expected an integer"),
    ({"seed": "1"}, "seed '1': expected a number"),
    ({"seed": False}, "seed False: expected a number"),
    ({"max_tokens": 0}, "max_tokens 0: must be >= 1"),
    ({"max_tokens": 10**30}, "max_tokens 1000000000000000000000000000000: must be >= 1"),
    ({"max_tokens": INF}, "max_tokens inf: expected an integer"),
    ({"max_tokens": 2.5}, "max_tokens 2.5: expected an integer"),
    ({"top_k": -1}, "top_k -1: must be >= 0"),
    ({"top_k": 2**63}, "top_k 9223372036854775808: must be >= 0"),
    ({"top_k": NAN}, "top_k nan: expected an integer"),
    ({"stop": [1]}, "stop [1]: expected a string or a list of strings"),
    ({"stop": ["a", None]}, "stop ['a', None]: expected a string or a list of strings"),
    ({"stop": {"a": 1}}, "stop {'a': 1}: expected a string or a list of strings"),
    ({"stop": 3}, "stop 3: expected a string or a list of strings"),
    ({"stop": False}, "stop False: expected a string or a list of strings"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop: 17 stop strings: at most 16"),
    ({"stop": ["a", "x" * (MAX_STOP_CHARS + 1)]},
     "stop: a stop string of 1025 characters: at most 1024"),
    ({"stop": ["a", ""]}, "stop: an empty stop string"),
    ({"stop": [""]}, "stop: an empty stop string"),
    ({"stop": ""}, "stop: an empty stop string"),  # as [""]: the same request, the same answer
    ({"stop_token_ids": [True]}, "stop_token_ids True: expected a number"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids 1.5: expected an integer"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids '1': expected a number"),
    ({"stop_token_ids": [-1]}, "stop_token_ids -1: a token id must be in [0, 2**31)"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids 2147483648: a token id must be in [0, 2**31)"),
    ({"stop_token_ids": [0] * 1025}, "stop_token_ids: 1025 token ids: at most 1024"),
    ({"stop_token_ids": 5}, "stop_token_ids 5: expected a list of token ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids '12': expected a list of token ids"),
    ({"ignore_eos": "yes"}, "ignore_eos 'yes': expected true or false"),
    ({"ignore_eos": 1}, "ignore_eos 1: expected true or false"),
    ({"ignore_eos": []}, "ignore_eos []: expected true or false"),
    ({"skip_special_tokens": 0}, "skip_special_tokens 0: expected true or false"),
    ({"cache_salt": ""}, "sampling parameter cache_salt: expected a string of 1 to 256"),
    ({"cache_salt": "x" * 257}, "sampling parameter cache_salt: expected a string of 1 to 256"),
    ({"cache_salt": 5}, "sampling parameter cache_salt: expected a string of 1 to 256"),
    ({"cache_salt": "g\0one"}, "sampling parameter cache_salt: holds the control character "
                                "U+0000"),
    (["temperature", 1], "sampling parameters ['temperature', 1]: expected a JSON object"),
    ("{}", "sampling parameters '{}': expected a JSON object"),
], ids=repr)
def test_bad_sampling_parameters_are_refused_by_name_and_value(bad, message):
    with pytest.raises(SamplingError, match=re.escape(message)):
        SamplingParams.from_dict(bad)


@pytest.mark.parametrize("good, field, value", [
    ({"temperature": 0}, "temperature", 0.0),
    ({"temperature": 1e-5}, "temperature", 1e-5),
    ({"temperature": 0.7}, "temperature", 0.7),
    ({"temperature": None}, "temperature", 0.0),
    ({"seed": 0}, "seed", 0),
    ({"seed": 2**64 - 1}, "seed", 2**64 - 1),
    ({"max_tokens": 5.0}, "max_tokens", 5),
    ({"stop": "x"}, "stop", ("x",)),
    ({"stop": ["a", "b"]}, "stop", ("a", "b")),
    ({"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}, "stop",
     ("x" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS),
    ({"stop": []}, "stop", ()),
    ({"stop_token_ids": [0, 2**31 - 1]}, "stop_token_ids", (0, 2**31 - 1)),
    ({"ignore_eos": False}, "ignore_eos", False),
], ids=repr)
def test_good_sampling_parameters_are_accepted(good, field, value):
    assert getattr(SamplingParams.from_dict(good), field) == value


class ReferenceStream:
    """The stop string handling as it was (quadratic in a stop string's length): the oracle."""

    def __init__(self, decode, stop):
        self.decode, self.stop, self.ids, self.sent, self.stopped = decode, stop, [], 0, False

    def push(self, token):
        self.ids.append(token)
        text = self.decode(self.ids)
        cut = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop)
               if i >= 0]
        if cut:
            self.stopped = True
            text = text[:min(cut)]
        elif text.endswith("\ufffd"):
            return ""
        else:
            hold = max((k for s in self.stop for k in range(1, len(s))
                        if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new

    def flush(self):
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        new = text[self.sent:]
        self.sent = len(text)
        return new


def random_case(rng: random.Random):
    """(the text after each push, stop strings). Mostly a text that grows by pieces of 0-3
    characters; sometimes a half character (U+FFFD) that the next push completes, and sometimes
    a decode that rewrites the text's last characters, as a tokenizer may."""
    alphabet = rng.choice(("ab", "ab", "abc"))
    stop = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
                 for _ in range(rng.randint(0, 3)))
    texts, text = [], ""
    for _ in range(rng.randint(1, 25)):
        roll = rng.random()
        if roll < 0.1 and text:  # rewrite the end
            keep = rng.randint(0, len(text))
            text = text[:keep] + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
        elif roll < 0.2:  # a half character now, the whole one at the next push
            texts.append(text + "\ufffd")
            text += rng.choice(alphabet)
        else:
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        texts.append(text)
    return texts, stop


def replay(stream_class, texts, stop, matcher_class=StopMatcher):
    """What a stream gives for each push (and `stopped`), then its flush, over `texts`."""
    stream = stream_class(lambda ids: texts[len(ids) - 1], stop)
    if stream_class is TextStream:
        stream.matcher = matcher_class(stop)
    return [(stream.push(i), stream.stopped) for i in range(len(texts))] + [stream.flush()]


def first_difference(matcher_class, cases=3000):
    rng = random.Random(1234)
    for _ in range(cases):
        texts, stop = random_case(rng)
        if replay(TextStream, texts, stop, matcher_class) != replay(ReferenceStream, texts, stop):
            return texts, stop
    return None


def test_stop_matcher_gives_what_the_quadratic_search_gave():
    assert first_difference(StopMatcher) is None


def test_the_equivalence_check_catches_a_matcher_that_holds_back_too_little():
    class HoldsOneFewer(StopMatcher):
        def find(self, text, sent):
            cut, hold = super().find(text, sent)
            return cut, max(0, hold - 1)

    assert first_difference(HoldsOneFewer) is not None


def test_a_long_stop_string_costs_time_linear_in_its_length():
    too_long = "ab" * (MAX_STOP_CHARS // 2) + "a"
    with pytest.raises(SamplingError, match=f"stop string of {MAX_STOP_CHARS + 1} characters"):
        SamplingParams.from_dict({"stop": too_long})
    # past the request limit, for the matcher alone: each 1000-character piece is the start of
    # the stop string, so it is all held back; testing each of the 200_000 prefixes against the
    # text's end at each push would take minutes, Knuth-Morris-Pratt a fraction of a second
    stop = "ab" * 100_000
    stream = TextStream(lambda ids: "ab" * 500 * len(ids), (stop,))
    assert [stream.push(i) for i in range(50)] == [""] * 50 and not stream.stopped
    assert stream.flush() == "ab" * 25_000
    stream = TextStream(lambda ids: "ab" * 500 * len(ids) + "!" * (len(ids) == 50), (stop,))
    assert "".join(stream.push(i) for i in range(50)) == "ab" * 25_000 + "!"


# ------------------------------------------------------------------ through Triton


def test_the_nucleus_is_the_stable_sorts_exactly():
    """The nucleus (values sorted, positions found by the cut value) keeps exactly the
    positions a stable sort keeps, on SmolLM2-sized rows with runs of tied logits; where the cut
    falls inside a run of ties, the first of them. Control: the last of the ties is another
    set."""
    for temperature in (0.7, 1.0):
        for row in logit_rows(8):
            z = row / np.float32(temperature)
            weights = np.exp(z - z.max())
            for top_p in (0.3, 0.9, 0.97):
                probs = weights.astype(np.float64) / weights.astype(np.float64).sum()
                assert np.array_equal(nucleus(weights, top_p), stable_nucleus(probs, top_p))
    tied = np.array([1.0, 0.5, 0.5, 0.5, 0.1], np.float32)  # cumulative 0.38 0.58 0.77 ...
    probs = tied.astype(np.float64) / tied.sum()
    assert list(nucleus(tied, 0.7)) == list(stable_nucleus(probs, 0.7)) == [0, 1, 2]
    # the control: ties ordered last first (as an unstable sort may) keep another set
    last_first = np.lexsort((-np.arange(tied.size), -probs))
    cut = int(np.searchsorted(np.cumsum(probs[last_first]), 0.7)) + 1
    assert sorted(last_first[:cut]) == [0, 2, 3] != list(nucleus(tied, 0.7))

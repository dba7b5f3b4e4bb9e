"""Sampling parameters, the sampler and the text stream of the generate model."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc.frontends.sampling import Sampler, SamplingError, SamplingParams, TextStream


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


# ------------------------------------------------------------------ through Triton

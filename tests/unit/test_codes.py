"""The error-code convention (codes.py) and Triton's sequence slots (repository.sequence_slots):
what carries a refusal's kind through Triton's gRPC stream and BLS, and what keeps refused
clients from starving the rest."""

from __future__ import annotations

import pytest

from triton_tlaloc.codes import GRPC_STATUS, coded_message, split_coded_message
from triton_tlaloc.repository import MIN_SEQUENCE_SLOTS, sequence_slots


@pytest.mark.parametrize("code", ["INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"])
def test_a_coded_message_gives_back_its_code_and_message(code):
    message = "sequence 5: KV pool full: [1] of 2"
    coded = coded_message(message, code)
    assert coded.startswith(f"[{code}] ")
    assert split_coded_message(coded) == (code, message)
    assert coded_message(coded, code) == coded, "coded once, however often it is passed on"
    assert code in GRPC_STATUS


@pytest.mark.parametrize("message", ["sequence 5: token id 7", "[400] bad", "[abc] x",
                                     "[NOT A CODE AT ALL, FAR TOO LONG] x", ""])
def test_a_message_without_a_known_code_is_left_as_it_is(message):
    assert split_coded_message(message) == (None, message)


def test_sequence_slots_are_many_more_than_the_pool_holds():
    assert sequence_slots(65) == MIN_SEQUENCE_SLOTS
    assert sequence_slots(5000) == 4999, "never fewer than the sequences the pool holds"
    assert sequence_slots(65, 64) == 64
    with pytest.raises(ValueError, match="fewer than the sequences the KV pool can hold"):
        sequence_slots(65, 10)

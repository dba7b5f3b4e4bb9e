"""openai_responses.failure_error: a model's failure is answered by its code (named in brackets
in its message, or its gRPC status): a refusal 400, a full model 503, a deadline 504, and the
server's own failure (INTERNAL, UNKNOWN, no code) a 500 server_error, never a 400."""

from __future__ import annotations

import pytest

from triton_tlaloc.codes import split_coded_message
from triton_tlaloc.frontends.client import GenerateResult
from triton_tlaloc.frontends.openai_responses import failure_error, refusal

BATCHER = "[INTERNAL] internal error in the batcher (see the server log)"
CASES = [
    (BATCHER, None, 500, "server_error"),
    (BATCHER, "INVALID_ARGUMENT", 500, "server_error"),  # the message names its code
    ("[request id: 7] " + BATCHER, None, 500, "server_error"),  # Triton's prefix
    ("internal error in the batcher", "StatusCode.INTERNAL", 500, "server_error"),
    ("something broke", None, 500, "server_error"),  # no code: the server's failure
    ("[INVALID_ARG] lora_admin: no such adapter", None, 400, "invalid_request_error"),
    ("[request id: 7] [INVALID_ARG] token id 5 ...", None, 400, "invalid_request_error"),
    ("no room", "StatusCode.INVALID_ARGUMENT", 400, "invalid_request_error"),
    ("[UNAVAILABLE] sequence 5: KV pool full", None, 503, "service_unavailable"),
]


@pytest.mark.parametrize("message, status, http, kind", CASES)
def test_a_failure_is_answered_by_its_code(message, status, http, kind):
    got = failure_error(message, status)
    assert (got.status, got.kind, got.message) == (http, kind, message)
    result = GenerateResult("", [], "error", 0, 0, 1, None, message, status)
    assert refusal(result).status == http


def old_send(message: str) -> int:
    """The adapter routes' mapping as it was: INTERNAL at the message's start a 500, any other
    failure a 400 (the control)."""
    code, _ = split_coded_message(message)
    return 500 if code == "INTERNAL" else 400


def test_control_the_old_mapping_answers_an_internal_error_400():
    wrong = [m for m, s, http, _ in CASES if http == 500 and old_send(m) != 500]
    assert wrong  # the prefixed and uncoded internal errors came back as 400s
    assert all(failure_error(m, s).status == 500 for m, s, http, _ in CASES if http == 500)

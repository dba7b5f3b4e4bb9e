"""Error codes by name, and the convention that carries them where Triton drops them.

The pure-Python parts (the batcher, the sampling checks) name an error's code with a string;
the Triton glue turns it into a TritonError code (backend.triton_error). Triton's gRPC stream
and a BLS call's response carry an error's message but not its code, and a caller must tell a
full pool (retry later) from a bad request: so the models' error messages begin with the code's
name in brackets, "[UNAVAILABLE] sequence 5: KV pool full ...".
"""

from __future__ import annotations

INVALID_ARG = "INVALID_ARG"  # the request is wrong: HTTP 400
UNAVAILABLE = "UNAVAILABLE"  # the server cannot take it now (pool full, unloading): HTTP 503
INTERNAL = "INTERNAL"  # the server failed: HTTP 500
CANCELLED = "CANCELLED"  # the client cancelled the request

# Triton's code names as gRPC status names (what a tritonclient exception's status() says).
GRPC_STATUS = {"INVALID_ARG": "INVALID_ARGUMENT", "UNAVAILABLE": "UNAVAILABLE",
               "INTERNAL": "INTERNAL", "CANCELLED": "CANCELLED", "NOT_FOUND": "NOT_FOUND",
               "UNSUPPORTED": "UNIMPLEMENTED", "ALREADY_EXISTS": "ALREADY_EXISTS",
               "UNKNOWN": "UNKNOWN"}


class RequestError(ValueError):
    """A request the artifact cannot run (too long, a refused token, drafts it cannot verify);
    names the problem. `reason` is a short label for counters (token, context, empty,
    speculation)."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


def coded_message(message: str, code: str) -> str:
    """`message` beginning with "[CODE] " (once)."""
    return message if message.startswith(f"[{code}] ") else f"[{code}] {message}"


def split_coded_message(message: str) -> tuple[str | None, str]:
    """(the code named in brackets at the start, the rest); (None, message) when none is."""
    if message.startswith("[") and "] " in message[:24]:
        code, rest = message[1:].split("] ", 1)
        if code in GRPC_STATUS:
            return code, rest
    return None, message

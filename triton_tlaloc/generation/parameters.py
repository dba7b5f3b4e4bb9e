"""The checks every request parameter of the generate model goes through (generation/sampling.py,
generation/speculative.py): a value of the wrong JSON type or out of range is refused with a
`SamplingError` that names the parameter and quotes the value, cut short. And the cache salt's
check, which every front end applies where the salt can still be seen whole."""

from __future__ import annotations

import hashlib
import math
import reprlib
import unicodedata


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names it."""


def shown(value) -> str:
    """`value` for a message, cut short: a request may send a megabyte where a number belongs."""
    try:
        return reprlib.repr(value)
    except ValueError:  # an int with more digits than Python will print
        return "<an integer too long to print>"


def refused(key: str, value, rule: str) -> SamplingError:
    return SamplingError(f"sampling parameter {key} {shown(value)}: {rule}")


def real(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refused(key, value, "expected a number")
    try:
        x = float(value)
    except OverflowError:  # an int beyond any float
        x = math.inf
    if not math.isfinite(x):
        raise refused(key, value, "must be a finite number")
    return x


def integer(key: str, value, low: int, high: int, rule: str) -> int:
    """`value` as an int in [low, high]; an integral float (5.0) counts, a bool does not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refused(key, value, "expected a number")
    if isinstance(value, float) and not value.is_integer():  # also NaN and inf
        raise refused(key, value, "expected an integer")
    n = int(value)
    if not low <= n <= high:
        raise refused(key, n, rule)
    return n


MAX_CACHE_SALT_CHARS = 256


def checked_cache_salt(salt, what: str):
    """`salt` when it is None or a string of 1 to MAX_CACHE_SALT_CHARS characters with no
    control character; ValueError naming it as `what` cache_salt otherwise (the sequence
    model's request parameter, the generate model's sampling parameter, a client's salt before
    it is sent). Triton keeps a request parameter as a C string, so a NUL ends it there:
    'g\0one' and 'g\0two' would reach the sequence model as the same salt 'g' and share
    cached KV. Salts with control characters are refused wherever they can still be seen whole
    (TlalocClient, the generate model's JSON, `tlaloc openai`)."""
    if salt is not None and (not isinstance(salt, str)
                             or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"{what} cache_salt: expected a string of 1 to {MAX_CACHE_SALT_CHARS} "
                         f"characters")
    if salt is not None and (bad := next((c for c in salt if unicodedata.category(c) == "Cc"),
                                         None)) is not None:
        raise ValueError(f"{what} cache_salt: holds the control character U+{ord(bad):04X}; "
                         f"a salt must be printable (Triton's string parameters end at a NUL)")
    return salt


# The sequence model's CACHE_SALT input (bytes, any value): at most this many
MAX_CACHE_SALT_BYTES = 1024


def salt_of_bytes(raw: bytes, what: str) -> str:
    """The cache salt a client gave as bytes (the sequence model's CACHE_SALT input, which
    carries any byte, NUL included): its key for the block hashes. Printable UTF-8 is the same
    salt as that string given as a parameter; anything else is keyed by its SHA-256 behind
    U+0001, which no checked string salt holds, so two different byte strings never share a
    key and none is a string salt's. ValueError naming `what` when empty or too long."""
    if not 0 < len(raw) <= MAX_CACHE_SALT_BYTES:
        raise ValueError(f"{what} CACHE_SALT: expected 1 to {MAX_CACHE_SALT_BYTES} bytes, got "
                         f"{len(raw)}")
    try:
        return checked_cache_salt(raw.decode("utf-8"), what)
    except ValueError:  # (UnicodeDecodeError is one)
        return "\x01" + hashlib.sha256(raw).hexdigest()


__all__ = ["MAX_CACHE_SALT_BYTES", "MAX_CACHE_SALT_CHARS", "SamplingError", "checked_cache_salt",
           "integer", "real", "refused", "salt_of_bytes", "shown"]

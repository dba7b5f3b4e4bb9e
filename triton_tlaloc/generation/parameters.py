"""The checks every request parameter of the generate model goes through (generation/sampling.py,
generation/speculative.py): a value of the wrong JSON type or out of range is refused with a
`SamplingError` that names the parameter and quotes the value, cut short."""

from __future__ import annotations

import math
import reprlib


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


__all__ = ["SamplingError", "integer", "real", "refused", "shown"]

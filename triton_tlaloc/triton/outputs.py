"""The sequence model's small outputs (docs/design.md#front-ends): ARGMAX and TOP_K_IDS /
TOP_K_LOGPROBS, a few bytes a step where LOGITS is the whole vocabulary. Pure numpy: no Triton,
no JAX."""

from __future__ import annotations

import json

import numpy as np

from ..generation.parameters import checked_cache_salt, salt_of_bytes

TOP_K_DEFAULT = 8


def top_k_parameter(parameters: str | dict | None, vocab: int) -> int:
    """K of the TOP_K outputs from a request's parameters (JSON, or parsed): top_k, default 8,
    an integer in [1, vocab]; ValueError naming the problem otherwise."""
    if not isinstance(parameters, dict):
        parameters = json.loads(parameters or "{}")
    k = parameters.get("top_k", TOP_K_DEFAULT)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"parameter top_k {k!r}: expected an integer in [1, {vocab}]")
    return k


def cache_salt_parameter(parameters: str | dict | None, raw: bytes | None = None) -> str | None:
    """A request's cache salt: prompts of different salts never share cached KV. Given as the
    parameter cache_salt (a printable string: Triton ends a string parameter at a NUL, so
    generation/parameters.py refuses control characters) or as the CACHE_SALT input's bytes
    `raw` (any bytes, NUL included, hashed whole), not both. None when absent; ValueError
    naming the problem otherwise."""
    if not isinstance(parameters, dict):
        parameters = json.loads(parameters or "{}")
    salt = checked_cache_salt(parameters.get("cache_salt"), "parameter")
    if raw is None:
        return salt
    if salt is not None:
        raise ValueError("cache salt given twice (the parameter cache_salt and the CACHE_SALT "
                         "input): give one")
    return salt_of_bytes(raw, "input")


# The outputs computed from a reply's logits: a verify call copies them out only for these.
LOGIT_OUTPUTS = frozenset({"LOGITS", "TOP_K_IDS", "TOP_K_LOGPROBS"})


def draft_tokens_parameter(parameters: dict) -> int:
    """A request's draft_tokens: how many of its last tokens are drafts to verify in one call
    (0, the default: none). An integer >= 0; ValueError naming the problem otherwise (the
    engine checks it against the request's tokens)."""
    n = parameters.get("draft_tokens", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"parameter draft_tokens {n!r}: expected an integer >= 0")
    return n


def small_outputs(logits: np.ndarray, wanted: set, k: int) -> dict[str, np.ndarray]:
    """ARGMAX [1, 1] and TOP_K_IDS / TOP_K_LOGPROBS [1, K] of one row's logits, those named in
    `wanted`. The top K are in descending order of log-probability (log-softmax over the
    vocabulary, in f64); ties keep the lower id first, as argmax does."""
    out = {}
    if "ARGMAX" in wanted:
        out["ARGMAX"] = np.array([[int(np.argmax(logits))]], np.int32)
    if wanted & {"TOP_K_IDS", "TOP_K_LOGPROBS"}:
        part = np.argpartition(-logits, k - 1)[:k]  # the K largest, unsorted
        order = part[np.lexsort((part, -logits[part]))]
        z = logits.astype(np.float64)
        m = z.max()
        logprobs = z[order] - (m + np.log(np.exp(z - m).sum()))
        out["TOP_K_IDS"] = order.astype(np.int32).reshape(1, -1)
        out["TOP_K_LOGPROBS"] = logprobs.astype(np.float32).reshape(1, -1)
    return out

"""Log-probabilities of the chosen tokens (docs/serving.md#log-probabilities): the model's
log-softmax over the raw logits of the row that chose them, before temperature, penalties,
logit_bias or a grammar's mask (vLLM's default, `raw_logprobs`), so they say what the model
thinks whatever the request did to the choice. Pure numpy."""

from __future__ import annotations

import numpy as np

MAX_TOP_LOGPROBS = 20  # as OpenAI allows


def logprob_entry(logits: np.ndarray, token: int, top: int) -> list:
    """[the token's log-probability, [[id, log-probability] of the `top` most likely,
    most likely first]] from one row's raw logits."""
    z = np.asarray(logits, np.float32).reshape(-1)
    peak = z.max()
    lse = peak + np.log(np.sum(np.exp(z - peak), dtype=np.float64))
    chosen = float(z[token] - lse)
    if not top:
        return [chosen, []]
    ids = np.argpartition(-z, top - 1)[:top] if top < z.size else np.arange(z.size)
    ids = ids[np.lexsort((ids, -z[ids]))]  # most likely first, ties to the lower id
    return [chosen, [[int(i), float(z[i] - lse)] for i in ids]]


__all__ = ["MAX_TOP_LOGPROBS", "logprob_entry"]

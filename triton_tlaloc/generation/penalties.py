"""What a request does to the logits before a token is chosen (docs/serving.md#sampling-controls),
by vLLM's definitions, on the raw logits (before temperature, as vLLM applies them):

- `logit_bias` ({token id: -100 to 100}): added to those ids' logits;
- `min_tokens`: the generation's end ids (EOS, stop_token_ids) refused until that many tokens
  were generated;
- `repetition_penalty` r (> 0): a token in the prompt or the output has its logit divided by r
  when positive, multiplied by r when not;
- `frequency_penalty` f and `presence_penalty` p (-2 to 2, OpenAI's): a token's logit less f
  times its count in the output, and less p if it is there at all.

`min_p` (the share of the most likely token's probability below which a token is dropped,
after temperature) is the sampler's (sampling.py). Pure numpy; `LogitsAdjuster` holds one
generation's counts.
"""

from __future__ import annotations

import numpy as np

from .parameters import SamplingError, integer, real, refused, shown

MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def checked(given: dict) -> dict:
    """The adjustments' parameters of a request (absent ones at their defaults), each refused
    by name when out of range."""
    out = {}
    for key in ("presence_penalty", "frequency_penalty"):
        value = real(key, given.get(key, 0.0))
        if not -2 <= value <= 2:
            raise refused(key, value, "must be in [-2, 2]")
        out[key] = value
    r = real("repetition_penalty", given.get("repetition_penalty", 1.0))
    if not 0 < r <= 10:
        raise refused("repetition_penalty", r, "must be in (0, 10] (1: none)")
    out["repetition_penalty"] = r
    min_p = real("min_p", given.get("min_p", 0.0))
    if not 0 <= min_p <= 1:
        raise refused("min_p", min_p, "must be in [0, 1]")
    out["min_p"] = min_p
    out["min_tokens"] = integer("min_tokens", given.get("min_tokens", 0), 0, 2**31 - 1,
                                "must be >= 0")
    bias = given.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise refused("logit_bias", bias, "expected an object of token id: bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingError(f"sampling parameter logit_bias: {len(bias)} entries: at most "
                            f"{MAX_LOGIT_BIAS}")
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise refused("logit_bias", key, "a key must be a token id") from None
        if not 0 <= token < 2**31 or str(token) != str(key).strip():
            raise refused("logit_bias", key, "a key must be a token id in [0, 2**31)")
        b = real(f"logit_bias[{token}]", value)
        if not -100 <= b <= 100:
            raise refused(f"logit_bias[{token}]", value, "must be in [-100, 100]")
        pairs.append((token, b))
    out["logit_bias"] = tuple(sorted(pairs))
    return out


def check_vocabulary(logit_bias, vocab: int) -> None:
    """A logit_bias id past the model's vocabulary is refused by name."""
    past = [t for t, _ in logit_bias if t >= vocab]
    if past:
        raise SamplingError(f"sampling parameter logit_bias: token id {shown(past[0])} is "
                            f"outside the vocabulary of {vocab} tokens")


def check_token_ids(params, vocab: int) -> None:
    """A request's token ids past the model's vocabulary (logit_bias's, stop_token_ids) are
    refused by name."""
    check_vocabulary(params.logit_bias, vocab)
    past = [t for t in params.stop_token_ids if t >= vocab]
    if past:
        raise SamplingError(f"sampling parameter stop_token_ids: token id {past[0]} is "
                            f"outside the vocabulary of {vocab} tokens (ids 0 to {vocab - 1})")


class LogitsAdjuster:
    """One generation's adjustments: `adjust(logits)` for the next choice, `took(tokens)` as
    tokens come next."""

    def __init__(self, params, prompt, ends):
        self.params = params
        self.ends = np.array(sorted(ends), np.int64)
        self.prompt = np.unique(np.asarray(list(prompt), np.int64))
        self.counts: dict[int, int] = {}  # output tokens: how often each came
        self.generated = 0
        self.bias_ids = np.array([t for t, _ in params.logit_bias], np.int64)
        self.bias = np.array([b for _, b in params.logit_bias], np.float32)

    def took(self, tokens) -> None:
        for t in tokens:
            self.counts[int(t)] = self.counts.get(int(t), 0) + 1
        self.generated += len(tokens)

    def adjust_positions(self, rows: np.ndarray, drafts: list[int]) -> np.ndarray:
        """A verify call's rows adjusted: row i as if `drafts[:i]` had come next (each
        position's counts after the drafts before it); the counts are left as they were."""
        counts, generated = dict(self.counts), self.generated
        try:
            out = []
            for i, row in enumerate(rows):
                out.append(self.adjust(row))
                if i < len(drafts):
                    self.took([drafts[i]])
            return np.stack(out)
        finally:
            self.counts, self.generated = counts, generated

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        z = np.array(logits, np.float32).reshape(-1)  # a copy: the reply's stays as it came
        n = z.size
        if self.bias_ids.size:
            keep = self.bias_ids < n
            z[self.bias_ids[keep]] += self.bias[keep]
        if self.generated < p.min_tokens and self.ends.size:
            z[self.ends[self.ends < n]] = -np.inf
        out_ids = np.fromiter(self.counts, np.int64, len(self.counts))
        out_ids = out_ids[(out_ids >= 0) & (out_ids < n)]
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self.prompt[self.prompt < n], out_ids)
            r = np.float32(p.repetition_penalty)
            z[seen] = np.where(z[seen] > 0, z[seen] / r, z[seen] * r)
        if out_ids.size and (p.frequency_penalty or p.presence_penalty):
            counts = np.array([self.counts[int(t)] for t in out_ids], np.float32)
            z[out_ids] -= (np.float32(p.frequency_penalty) * counts
                           + np.float32(p.presence_penalty))
        return z


def adjusts(params) -> bool:
    """Whether the parameters change the logits at all."""
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias
                or params.repetition_penalty != 1.0 or params.min_tokens)


__all__ = ["LogitsAdjuster", "MAX_LOGIT_BIAS", "adjusts", "check_vocabulary", "checked"]

"""Server-side generation pieces for the generate model (docs/design.md#front-ends): sampling
parameters, a sampler, and the text a stream of token ids adds. Pure numpy: no Triton, no JAX.

Sampling follows the usual order (as vllm and transformers do): temperature, then top-k, then
top-p over what is left, then a draw from a numpy Generator seeded by `seed` (a seeded request
repeats exactly); temperature 0 is greedy (the argmax, ties to the lower id).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids",
            "ignore_eos")

    @staticmethod
    def from_dict(d: dict) -> "SamplingParams":
        unknown = sorted(set(d) - set(SamplingParams.KEYS))
        if unknown:
            raise SamplingError(f"unknown sampling parameter(s) {', '.join(unknown)} (known: "
                                f"{', '.join(SamplingParams.KEYS)})")
        stop = d.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)

        def number(key, kind, default):
            v = d.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                    kind is int and not float(v).is_integer()):
                raise SamplingError(f"sampling parameter {key} {v!r}: expected a number")
            return kind(v)

        p = SamplingParams(
            max_tokens=number("max_tokens", int, 16),
            temperature=number("temperature", float, 0.0),
            top_k=number("top_k", int, 0),
            top_p=number("top_p", float, 1.0),
            seed=None if d.get("seed") is None else number("seed", int, 0),
            stop=tuple(str(s) for s in stop),
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids") or ()),
            ignore_eos=bool(d.get("ignore_eos", False)))
        if p.max_tokens < 1:
            raise SamplingError(f"sampling parameter max_tokens {p.max_tokens}: must be >= 1")
        if p.temperature < 0:
            raise SamplingError(f"sampling parameter temperature {p.temperature}: must be >= 0")
        if p.top_k < 0:
            raise SamplingError(f"sampling parameter top_k {p.top_k}: must be >= 0 (0: all)")
        if not 0 < p.top_p <= 1:
            raise SamplingError(f"sampling parameter top_p {p.top_p}: must be in (0, 1]")
        if any(not s for s in p.stop):
            raise SamplingError("sampling parameter stop: an empty stop string")
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Chooses each next token from a step's logits under one request's parameters."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def choose(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z >= kth, z, -np.inf)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:  # the smallest set of most likely tokens whose mass reaches top_p
            order = np.argsort(-probs, kind="stable")
            mass = np.cumsum(probs[order])
            keep = order[:int(np.searchsorted(mass, p.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self.rng.choice(probs.size, p=probs))


class TextStream:
    """The text a growing list of token ids adds at each step, decoded as a whole each time so
    multi-token characters come out right (an incomplete one, U+FFFD at the end, is held back),
    cut before the first stop string."""

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode = decode  # ids -> text
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False

    def push(self, token: int) -> str:
        """The new text after `token`; sets `stopped` when a stop string appeared."""
        self.ids.append(token)
        text = self.decode(self.ids)
        cut = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop)
               if i >= 0]
        if cut:
            self.stopped = True
            text = text[:min(cut)]
        elif text.endswith("\ufffd"):
            return ""
        else:  # hold back a tail that may be the start of a stop string
            hold = max((k for s in self.stop for k in range(1, len(s))
                        if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new

    def flush(self) -> str:
        """What was held back, at the end of the generation (no stop string came)."""
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        new = text[self.sent:]
        self.sent = len(text)
        return new

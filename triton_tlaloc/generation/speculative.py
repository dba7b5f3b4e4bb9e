"""Speculation in the generate model's loops (docs/design.md#speculative-decoding): a request's
`speculative` sampling parameter, how many drafts each step carries, and, with temperature above
0, which drafts stand. Pure Python and numpy: no Triton, no JAX.

- `SpeculativeParams`: {"method": "prompt_lookup" | "draft_model", "num_draft_tokens": k, ...},
  checked when the request arrives like every other sampling parameter. A draft model is the
  one the generate model's configuration names (generation/draft_model.py).
- `DraftLength`: the adaptive rule. Each draft position is accepted with some probability a,
  estimated from what the generation saw (decayed, so it follows the text as it changes; one
  estimate after a step whose drafts all stood, one after a miss: repeats come in runs). A
  step with k drafts then yields 1 + a + ... + a**k tokens on average, and costs what a call on
  its verify entry costs against a decode call (`StepCost`: measured on this server when it
  has run both, else `DRAFT_COST` a token), plus, with a draft model, the k tokens it drafts
  (`DraftModelCost`); the length is the k that yields the most tokens for
  the time, 0 when none beats a plain step. At 0 the generation stops drafting but keeps
  checking, for free, whether the drafts it would have sent were right, and starts again when
  they are (a draft model's drafts are not free: one is sent every PROBE_EVERY steps).
- `sampled_acceptance`: speculative sampling (Leviathan et al., Chen et al.) for a drafter that
  proposes one token with certainty (prompt lookup, a draft model decoding greedily): a draft x stands with probability p(x) (the
  target's probability after temperature, top-k and top-p; min(1, p/q) with q = 1); the first
  that falls is replaced by a draw from p without x, renormalized (the residual max(0, p - q));
  after every draft stood, one more token is drawn from p. Each token so chosen is distributed
  exactly as a token sampled without speculation.
- `Speculator`: one generation's drafting: the n-gram index (or a draft model's drafts), the
  draft length, the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .drafting import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramIndex
from .parameters import SamplingError, integer, refused

METHODS = ("prompt_lookup", "draft_model")
MAX_DRAFT_TOKENS = 64
MAX_NGRAM = 16
# What one verified token costs, as a share of a decode step, until calls on the entries were
# timed. Measured on SmolLM2 f32 on 2 CPU cores (docs/performance.md#speculative-decoding): a
# call of 5 or 7 tokens took 1.6-1.9 steps' time, about 0.15 a token; one of 9, 3.5.
DRAFT_COST = 0.3
# A token a draft model drafts, against a decode step of the target, until drafts were timed: a
# draft model a tenth of the target's size, and the round trip to it.
DRAFT_MODEL_COST = 0.2
# A generation drafting with a model that drafts none checks it again with one draft this often
# (a draft model's drafts cost a step each: there is no free check as prompt lookup's).
PROBE_EVERY = 16
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 2.0  # a start of two draft positions, 60% accepted
PRIOR_RUN_ACCEPTANCE = 0.8  # after a step whose drafts all stood: likelier (repeats run on)
DECAY = 0.9  # per observation: the estimate follows the last ten or so


@dataclass(frozen=True)
class SpeculativeParams:
    method: str = "prompt_lookup"
    num_draft_tokens: int = 4  # the most drafts a step carries
    prompt_lookup_max: int = DEFAULT_MAX_NGRAM  # the longest n-gram looked up
    prompt_lookup_min: int = DEFAULT_MIN_NGRAM
    adaptive: bool = True  # draft less, or not at all, while drafts are rejected

    KEYS = ("method", "num_draft_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive")

    @staticmethod
    def from_dict(d) -> "SpeculativeParams | None":
        """The `speculative` sampling parameter: None (or absent) for none."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise refused("speculative", d, 'expected a JSON object such as {"method": '
                                            '"prompt_lookup", "num_draft_tokens": 4}')
        unknown = sorted(str(k) for k in set(d) - set(SpeculativeParams.KEYS))
        if unknown:
            raise SamplingError(f"sampling parameter unknown speculative parameter(s) "
                                f"{', '.join(unknown)} (known: "
                                f"{', '.join(SpeculativeParams.KEYS)})")
        given = {k: v for k, v in d.items() if v is not None}
        method = given.get("method") or "prompt_lookup"
        if method not in METHODS:
            raise refused("speculative.method", method, f"expected one of {', '.join(METHODS)}")

        def count(key: str, default: int, low: int, high: int) -> int:
            return integer(f"speculative.{key}", given.get(key, default), low, high,
                           f"must be in [{low}, {high}]")
        most = count("num_draft_tokens", 4, 1, MAX_DRAFT_TOKENS)
        high = count("prompt_lookup_max", DEFAULT_MAX_NGRAM, 1, MAX_NGRAM)
        low = count("prompt_lookup_min", min(DEFAULT_MIN_NGRAM, high), 1, high)
        adaptive = given.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise refused("speculative.adaptive", adaptive, "expected true or false")
        return SpeculativeParams(method, most, high, low, adaptive)


class StepCost:
    """What a step carrying k drafts costs against a decode step: its call runs on the smallest
    verify entry of at least k + 1 tokens, whose recent call time `seconds(kind, tokens)` gives
    when both kinds were timed (None otherwise: `DRAFT_COST` a token)."""

    REFRESH = 256  # costs looked up before the measurements are read again

    def __init__(self, verify_tokens: tuple[int, ...] = (),
                 seconds: Callable[[str, int], float | None] | None = None):
        self.verify_tokens, self.seconds = sorted(verify_tokens), seconds
        self._known: dict[int, float] = {}
        self._uses = 0

    def __call__(self, k: int) -> float:
        self._uses += 1
        if self._uses % self.REFRESH == 0:
            self._known.clear()
        if k not in self._known:
            self._known[k] = self._measure(k)
        return self._known[k]

    def _measure(self, k: int) -> float:
        tokens = next((t for t in self.verify_tokens if t >= k + 1), k + 1)
        if self.seconds is not None:
            decode, verify = self.seconds("decode", 1), self.seconds("verify", tokens)
            if decode and verify:
                return verify / decode
        return 1.0 + DRAFT_COST * (tokens - 1)


class DraftModelCost:
    """What a step with k drafts from a draft model costs against a decode step: its verify
    call (`StepCost`) and the k tokens drafted, each `seconds_per_draft()` (as the generation
    measured them, None until then) over the target's decode call time."""

    def __init__(self, step: StepCost, seconds_per_draft: Callable[[], float | None]):
        self.step, self.seconds_per_draft = step, seconds_per_draft

    def __call__(self, k: int) -> float:
        per = self.seconds_per_draft()
        decode = self.step.seconds("decode", 1) if self.step.seconds is not None else None
        return self.step(k) + k * (per / decode if per and decode else DRAFT_MODEL_COST)


def best_length(most: int, cost: Callable[[int], float], acceptance: float = 1.0) -> int:
    """How many tokens after its own a step should feed (at most `most`) when each stands with
    probability `acceptance` (1: a grammar's forced tokens) and a step feeding k costs
    `cost(k)` decode steps: the k that yields the most tokens for the time, 0 when none beats
    a plain step."""
    best, best_rate = 0, 1.0  # a plain step: one token for one step's time
    expected = 1.0
    for k in range(1, most + 1):
        expected += acceptance ** k  # tokens a step with k drafts yields, on average
        rate = expected / cost(k)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class DraftLength:
    """How many drafts the next step carries (see the module's docstring). `observe(tried,
    stood)`: of `tried` draft positions checked, the first `stood` were right.

    The acceptance is estimated twice: after a step whose drafts all stood, and after one where
    one fell. Text that repeats its input comes in runs (a quoted sentence, an unchanged line of
    code: every draft right until the run ends), so a draft right after a run of right ones is
    likelier than the average says, and one after a miss less likely; a single estimate drafts
    too little inside runs and too much between them."""

    def __init__(self, most: int, adaptive: bool = True,
                 cost: Callable[[int], float] | None = None):
        assert most >= 1
        self.most, self.adaptive, self.cost = most, adaptive, cost or StepCost()
        # [after a miss, after every draft stood]
        self.stood = [PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_RUN_ACCEPTANCE * PRIOR_WEIGHT]
        self.tried = [PRIOR_WEIGHT] * 2
        self.in_run = 0  # whether the last step's drafts all stood

    @property
    def acceptance(self) -> float:
        """The estimated probability that the next step's draft positions are right."""
        return self.stood[self.in_run] / self.tried[self.in_run]

    def __call__(self) -> int:
        if not self.adaptive:
            return self.most
        return best_length(self.most, self.cost, self.acceptance)

    def observe(self, tried: int, stood: int) -> None:
        assert 0 <= stood <= tried
        if tried:
            state = self.in_run
            self.stood[state] = DECAY * self.stood[state] + stood
            self.tried[state] = DECAY * self.tried[state] + tried
            self.in_run = int(stood == tried)


def sampled_acceptance(sampler, position_logits: np.ndarray,
                       drafts: list[int]) -> tuple[int, int]:
    """Which drafts stand under speculative sampling, and the token that follows them.
    `position_logits[i]` are the logits after the token before draft i (the last row: after
    the last draft), adjusted by the request's penalties already (LogitsAdjuster.
    adjust_positions); `sampler` is the request's (`Sampler`: its parameters and generator)."""
    for i, draft in enumerate(drafts):
        ids, weights = sampler.distribution(position_logits[i])
        at = _position(ids, draft, weights.size)
        total = float(weights.sum(dtype=np.float64))
        p = float(weights[at]) / total if at >= 0 else 0.0
        if sampler.rng.random() < p:
            continue  # the draft stands
        if at >= 0:  # the residual: p without the draft
            weights = weights.copy()
            weights[at] = 0
        return i, sampler.draw(ids, weights)
    return len(drafts), sampler.pick(position_logits[len(drafts)])


def greedy_acceptance(position_logits, drafts: list[int]) -> tuple[int, int]:
    """Which drafts stand under greedy decoding, read from each position's logits (a verify
    call's argmax does the same on the device; this is the rule where the logits are changed on
    the host first: a grammar's mask)."""
    for i, draft in enumerate(drafts):
        choice = int(np.argmax(position_logits[i]))
        if choice != draft:
            return i, choice
    return len(drafts), int(np.argmax(position_logits[len(drafts)]))


def _position(ids: np.ndarray | None, token: int, n: int) -> int:
    """Where `token` is among the candidates (-1: not one of them)."""
    if ids is None:
        return token if 0 <= token < n else -1
    at = int(np.searchsorted(ids, token))
    return at if at < ids.size and int(ids[at]) == token else -1


class Speculator:
    """One generation's drafting: prompt lookup over everything so far (an `NgramIndex`), or
    a draft model's drafts (handed to `sending`); the draft length, and the check of the drafts
    it did not send."""

    def __init__(self, params: SpeculativeParams, history: list[int], most: int,
                 cost: Callable[[int], float] | None = None):
        self.params = params
        self.index = (NgramIndex(history, params.prompt_lookup_max, params.prompt_lookup_min)
                      if params.method == "prompt_lookup" else None)
        self.length = DraftLength(max(1, min(params.num_draft_tokens, most)), params.adaptive,
                                  cost)
        self.sent: list[int] = []  # the drafts of the step in flight
        self.unsent: list[int] = []  # what it would have sent, with none sent
        self.plain_steps = 0

    def count(self, room: int) -> int:
        """How many drafts the next step carries (at most `room`). A draft model drafting
        none drafts one every PROBE_EVERY steps: its acceptance is known only by drafting."""
        k = min(self.length(), room)
        if k == 0 and self.index is None and room >= 1:
            self.plain_steps += 1
            k = int(self.plain_steps % PROBE_EVERY == 0)
        return k

    def drafts(self, room: int, cut: Callable[[list[int]], list[int]] | None = None
               ) -> list[int]:
        """Prompt lookup's drafts for the next step (at most `room`), or [] for a plain decode
        step. `cut`: what of a list of drafts may be sent (a grammar's: those it allows)."""
        k = self.count(room)
        drafts = self.index.lookup(k) if k > 0 else []
        unsent = [] if drafts or room < 1 else self.index.lookup(1)
        if cut is not None:
            drafts, unsent = cut(drafts), cut(unsent)
        self.sent, self.unsent = drafts, unsent
        return self.sent

    def sending(self, drafts: list[int]) -> list[int]:
        """A draft model's drafts for the next step."""
        self.sent, self.unsent = list(drafts), []
        return self.sent

    def took(self, tokens: list[int]) -> None:
        """The step's tokens: the drafts that stood and the one after them (or, with no drafts,
        the one token)."""
        if self.sent:
            stood = len(tokens) - 1
            self.length.observe(stood + (stood < len(self.sent)), stood)
        elif self.unsent:
            self.length.observe(1, int(tokens[0] == self.unsent[0]))
        self.sent, self.unsent = [], []
        if self.index is not None:
            self.index.extend(tokens)


__all__ = ["DRAFT_COST", "DRAFT_MODEL_COST", "DraftLength", "DraftModelCost",
           "SpeculativeParams", "Speculator", "StepCost", "best_length", "greedy_acceptance",
           "sampled_acceptance"]

"""Server-side generation pieces for the generate model (docs/design.md#front-ends): sampling
parameters, a sampler, and the text a stream of token ids adds. Pure numpy: no Triton, no JAX.

Sampling follows the usual order (as vllm and transformers do): temperature, then top-k, then
top-p over what is left, then a draw from a numpy Generator seeded by `seed` (a seeded request
repeats exactly); temperature 0 is greedy (the argmax, ties to the lower id).

Every parameter is checked when the request arrives, so a bad one is refused by name rather than
failing later as an internal error; stop strings are bounded in number and length, and matched
in time linear in the text (Knuth-Morris-Pratt) however long they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import penalties
from .logprobs import MAX_TOP_LOGPROBS
from .parameters import SamplingError, checked_cache_salt, integer, real, refused, shown
from .speculative import SpeculativeParams
from .structured import StructuredOutput

MAX_STOP_STRINGS = 16  # per request
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 1024  # per request
MIN_TEMPERATURE = 1e-5  # a smaller positive one divides logits into inf and NaN
INT64_MAX = 2**63 - 1


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
    # The tenant of the prompt's cached KV: prompts of different salts share none (a cache hit
    # is a timing signal that someone sent the same prefix).
    cache_salt: str | None = None
    # The LoRA adapter the sequence runs with, by name (the sequence model's lora_adapters)
    lora: str | None = None
    # Drafts verified in one call (generation/speculative.py); None: one token a step.
    speculative: SpeculativeParams | None = None
    # A grammar every chosen token must keep to (generation/structured.py); None: free text.
    structured_output: StructuredOutput | None = None
    # What the logits get before a choice (generation/penalties.py), and min_p's cut
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # Each chosen token's log-probability and this many most likely (generation/logprobs.py);
    # None: none
    logprobs: int | None = None
    # Every prompt token's log-probability (the first has none) and this many most likely at
    # its position, computed by feeding the prompt a few tokens a call (generation/logprobs.py's
    # PromptScoring); None: none
    prompt_logprobs: int | None = None
    # Whether the text leaves out special tokens (vLLM's default); false keeps them, as a
    # tool-call parser that reads a special marker (mistral's [TOOL_CALLS]) needs
    skip_special_tokens: bool = True

    KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids",
            "ignore_eos", "cache_salt", "lora", "speculative", "structured_output",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
            "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens")

    @staticmethod
    def from_dict(d: dict) -> "SamplingParams":
        """The parameters of a request's JSON object; absent or null ones take their defaults."""
        if not isinstance(d, dict):
            raise SamplingError(f"sampling parameters {shown(d)}: expected a JSON object")
        unknown = sorted(str(k) for k in set(d) - set(SamplingParams.KEYS))
        if unknown:
            raise SamplingError(f"unknown sampling parameter(s) {', '.join(unknown)} (known: "
                                f"{', '.join(SamplingParams.KEYS)})")
        given = {k: v for k, v in d.items() if v is not None}

        max_tokens = integer("max_tokens", given.get("max_tokens", 16), 1, INT64_MAX,
                              "must be >= 1 (and below 2**63)")
        top_k = integer("top_k", given.get("top_k", 0), 0, INT64_MAX,
                         "must be >= 0 (0: all) and below 2**63")
        seed = given.get("seed")
        if seed is not None:
            seed = integer("seed", seed, 0, 2**64 - 1, "must be an integer in [0, 2**64)")
        temperature = real("temperature", given.get("temperature", 0.0))
        if temperature < 0:
            raise refused("temperature", temperature, "must be >= 0")
        if 0 < temperature < MIN_TEMPERATURE:
            raise refused("temperature", temperature,
                           f"must be 0 (greedy) or at least {MIN_TEMPERATURE!r}")
        top_p = real("top_p", given.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            raise refused("top_p", top_p, "must be in (0, 1]")

        stop = given.get("stop", ())
        if isinstance(stop, str):
            # "" is refused below as [""] is, as vLLM refuses both: a stop string that matches
            # everywhere is never what a client means, and "" standing for "no stop" while
            # [""] was refused made the same request mean two things.
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise refused("stop", stop, "expected a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"sampling parameter stop: {len(stop)} stop strings: at most "
                                f"{MAX_STOP_STRINGS}")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            longest = max(map(len, stop))
            raise SamplingError(f"sampling parameter stop: a stop string of {longest} "
                                f"characters: at most {MAX_STOP_CHARS}")
        if any(not s for s in stop):
            raise SamplingError("sampling parameter stop: an empty stop string")

        stop_token_ids = given.get("stop_token_ids", ())
        if not isinstance(stop_token_ids, (list, tuple)):
            raise refused("stop_token_ids", stop_token_ids, "expected a list of token ids")
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"sampling parameter stop_token_ids: {len(stop_token_ids)} "
                                f"token ids: at most {MAX_STOP_TOKEN_IDS}")
        stop_token_ids = tuple(
            integer("stop_token_ids", t, 0, 2**31 - 1, "a token id must be in [0, 2**31)")
            for t in stop_token_ids)

        ignore_eos = given.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise refused("ignore_eos", ignore_eos, "expected true or false")
        skip_special_tokens = given.get("skip_special_tokens", True)
        if not isinstance(skip_special_tokens, bool):
            raise refused("skip_special_tokens", skip_special_tokens, "expected true or false")

        try:
            cache_salt = checked_cache_salt(given.get("cache_salt"), "sampling parameter")
        except ValueError as e:
            raise SamplingError(str(e)) from None

        lora = given.get("lora")
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise refused("lora", lora, "expected an adapter's name")
        speculative = SpeculativeParams.from_dict(given.get("speculative"))
        structured = StructuredOutput.from_dict(given.get("structured_output"))
        adjusted = penalties.checked(given)
        if adjusted["min_tokens"] > max_tokens:
            raise SamplingError(f"sampling parameter min_tokens {adjusted['min_tokens']}: "
                                f"more than max_tokens {max_tokens}")

        logprobs = _top_count(given, "logprobs", False, "each chosen one")
        # Not with speculative or structured_output: a prompt fed as a verify call's forced
        # tokens would share the call with their drafts and forced tokens; not built.
        prompt_logprobs = _top_count(given, "prompt_logprobs",
                                     speculative is not None or structured is not None,
                                     "each prompt token")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=tuple(stop),
                                stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                                cache_salt=cache_salt, lora=lora, speculative=speculative,
                                structured_output=structured, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs,
                                skip_special_tokens=skip_special_tokens, **adjusted)
        return params

    def to_dict(self) -> dict:
        """The parameters as a request's JSON object (from_dict(to_dict()) gives them back)."""
        d = {k: getattr(self, k) for k in self.KEYS}
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        if self.speculative is not None:
            d["speculative"] = dataclasses.asdict(self.speculative)
        if self.structured_output is not None:
            d["structured_output"] = self.structured_output.as_dict()
        d["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return d

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _top_count(given: dict, key: str, constrained: bool, beside: str) -> int | None:
    """A logprobs parameter: how many most likely tokens go `beside` each one, or None."""
    value = given.get(key)
    if value is None:
        return None
    value = integer(key, value, 0, MAX_TOP_LOGPROBS, f"must be in [0, {MAX_TOP_LOGPROBS}] "
                                                     f"(the most likely tokens given {beside})")
    if constrained:
        raise SamplingError(f"sampling parameter {key}: not with speculative or "
                            f"structured_output")
    return value


class Sampler:
    """Chooses each next token from a step's logits under one request's parameters.

    The draw is what `Generator.choice(vocab, p=probs)` makes of the distribution left after
    top-k and top-p (one uniform number; the first token whose cumulative probability passes
    it), computed without touching the whole vocabulary more than a few vector passes: top-k
    and top-p look only at the tokens within a margin of the most likely, widened until they
    hold what is asked, and the cumulative sum is taken over blocks, then inside one. Done over
    a 49k vocabulary the plain way (a full sort for top-p), a row took 1-6 ms; generations
    sample on the batcher's thread, where a row's cost is paid by every sequence in the call.
    """

    def __init__(self, params: SamplingParams, prompt=(), ends=()):
        """`prompt` and `ends` (the generation's end ids) for the penalties and min_tokens,
        when the parameters ask for them."""
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.adjuster = (penalties.LogitsAdjuster(params, prompt, ends)
                         if penalties.adjusts(params) else None)

    def choose(self, logits: np.ndarray) -> int:
        if self.adjuster is not None:
            logits = self.adjuster.adjust(logits)
        return self.pick(logits)

    def pick(self, logits: np.ndarray) -> int:
        """The choice from logits already adjusted (the penalties applied, or none asked)."""
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, weights = self.distribution(logits)
        return self.draw(ids, weights)

    def took(self, tokens) -> None:
        """`tokens` came next (chosen or not): the penalties count them."""
        if self.adjuster is not None:
            self.adjuster.took(tokens)

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """What a draw chooses from (not greedy): the candidates' token ids, ascending (None:
        the whole vocabulary), and their weights (not normalized) after temperature, top-k
        and top-p."""
        p = self.params
        # float32, as the logits are (a float64 exp took ten times as long here)
        z = np.asarray(logits, np.float32) / np.float32(p.temperature)
        if p.min_p > 0:  # below min_p times the most likely token's probability: out
            z = np.where(z >= z.max() + np.float32(np.log(p.min_p)), z, np.float32(-np.inf))
        ids = None
        if p.top_k and p.top_k < z.size:
            ids = top_k_ids(z, p.top_k)
            z = z[ids]
        weights = np.exp(z - z.max())
        if p.top_p < 1.0:
            keep = nucleus(weights, p.top_p)
            ids = keep if ids is None else ids[keep]
            weights = weights[keep]
        return ids, weights

    def draw(self, ids: np.ndarray | None, weights: np.ndarray) -> int:
        """One token from a distribution (`distribution`'s form)."""
        at = inverse_cdf(weights, self.rng.random())
        return at if ids is None else int(ids[at])


# How far below the largest logit (after temperature) top-k looks first, then wider; and the
# weights (relative to the largest) top-p looks down to first, then lower.
TOP_K_MARGINS = (8.0, 16.0, 32.0, 64.0)
NUCLEUS_FLOORS = (1e-3, 1e-6, 1e-12)
CDF_BLOCK = 1024


def top_k_ids(z: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) of the k largest values, with every value tied with the k-th."""
    top = z.max()
    for margin in TOP_K_MARGINS:  # a partition of the few near the top, not of them all
        near = np.flatnonzero(z >= top - margin)
        if near.size >= k:
            break
    else:
        near = np.arange(z.size)
    kth = np.partition(z[near], -k)[-k]
    return near[z[near] >= kth]


def nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """The positions (ascending) of the smallest set of largest weights whose share of the
    total reaches top_p; ties in position order, as a stable sort of them all would take them.
    Only the weights above a floor are sorted, the floor lowered while they fall short."""
    probs = weights.astype(np.float64)  # the mass of thousands of tokens, summed exactly
    probs /= probs.sum()
    largest = weights.max()
    for floor in NUCLEUS_FLOORS + (0.0,):
        head = (np.flatnonzero(weights >= floor * largest) if floor else
                np.arange(weights.size))  # every weight above the floor: a head of the order
        if floor and probs[head].sum() < top_p:
            continue  # not enough: a lower floor, before sorting any
        # The values sorted, not their positions (2.3 times faster at 49,152): tied values are
        # equal, so the running sum is the stable sort's, and the cut value t tells which
        # positions it kept: every one above t, and of those equal to t the first ones.
        p = probs[head]
        values = np.sort(p)[::-1]
        end = int(np.searchsorted(np.cumsum(values), top_p))
        if end < values.size:
            cut = values[end]
            above = head[p > cut]
            return np.sort(np.concatenate([above, head[p == cut][:end + 1 - above.size]]))
    return head  # rounding kept the whole mass just short of top_p: all of it


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The first position whose cumulative weight exceeds u (in [0, 1)) times the total:
    block sums first, then a cumulative sum inside one block (a cumulative sum of 49k values
    alone took 0.2 ms). A position of zero weight is never returned."""
    n = weights.size
    if n <= 4 * CDF_BLOCK:
        cdf = np.cumsum(weights, dtype=np.float64)
        at = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    else:
        full = n - n % CDF_BLOCK
        sums = weights[:full].reshape(-1, CDF_BLOCK).sum(axis=1, dtype=np.float64)
        if full < n:
            sums = np.append(sums, weights[full:].sum(dtype=np.float64))
        cum = np.cumsum(sums)
        target = u * cum[-1]
        b = min(int(np.searchsorted(cum, target, side="right")), sums.size - 1)
        block = weights[b * CDF_BLOCK:(b + 1) * CDF_BLOCK]
        inner = np.cumsum(block, dtype=np.float64)
        at = b * CDF_BLOCK + int(np.searchsorted(inner, target - (cum[b - 1] if b else 0.0),
                                                 side="right"))
    at = min(at, n - 1)
    while weights[at] == 0 and at > 0:  # rounding past the last weight: the one before it
        at -= 1
    return at


def _borders(s: str) -> list[int]:
    """The Knuth-Morris-Pratt prefix function: [i] is the length of the longest proper prefix of
    s[:i + 1] that is also its suffix (where a partial match falls back to on a mismatch)."""
    border = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[k] != s[i]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border


class StopMatcher:
    """Where stop strings occur in a growing text, and how much of its end may begin one.

    A Knuth-Morris-Pratt automaton per stop string looks at each character a bounded number of
    times (amortized), whatever the stop strings hold; testing every prefix of a stop string
    against the text's end, as before, took time quadratic in its length. The automata's states
    carry over from one call to the next, so a call scans only the new characters. When the text
    changed where the last call looked (a decode may rewrite its last characters), and after a
    match, they scan again from where the unsent text could begin a stop string: time linear in
    the unsent characters plus the stop string's length.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.borders = [_borders(s) for s in stop]
        self.reach = max(map(len, stop), default=1) - 1  # how far before `sent` one may start
        self.states = [0] * len(stop)  # of each automaton after text[:end]
        self.end = self.sent = 0  # of the last call
        # text[sent - reach:end] of the last call: while it is unchanged, so are the states (they
        # depend on the last reach characters) and the absence of a stop string there
        self.tail = ""
        self.resumable = False

    def find(self, text: str, sent: int) -> tuple[int, int]:
        """(where the earliest stop string starts in `text`, or -1; how many characters at its
        end are the start of a stop string, when none is in it). A stop string may begin before
        `sent`, the characters already returned, only where they were held back: from
        sent - len(s) + 1 on."""
        resume = (self.resumable and self.sent <= sent <= self.end
                  and text.startswith(self.tail, self.end - len(self.tail)))
        cuts, holds = [], []
        for n, s in enumerate(self.stop):
            search_from = max(0, sent - len(s) + 1)
            if resume:  # a match ending in the new characters starts at search_from or after
                start, state = self.end, self.states[n]
            else:  # early enough for the matches from search_from and for the held back end
                start, state = min(search_from, max(0, len(text) - len(s) + 1)), 0
            cut, self.states[n] = self._scan(n, text, start, state, search_from)
            if cut >= 0:
                cuts.append(cut)
            holds.append(self.states[n])
        self.resumable = not cuts  # a scan that found a match stopped short of the end
        self.end, self.sent = len(text), sent
        self.tail = text[max(0, min(sent, len(text)) - self.reach):]
        return (min(cuts), 0) if cuts else (-1, max(holds, default=0))

    def _scan(self, n: int, text: str, start: int, state: int, search_from: int):
        """Runs stop string n's automaton over text[start:] from `state`: (where its first
        match from search_from on starts, or -1; the state where it stopped)."""
        s, border = self.stop[n], self.borders[n]
        for i in range(start, len(text)):
            c = text[i]
            while state and s[state] != c:
                state = border[state - 1]
            if s[state] == c:
                state += 1
            if state == len(s):
                if i - len(s) + 1 >= search_from:
                    return i - len(s) + 1, state
                state = border[-1]  # a match in text sent already: not a stop
        return -1, state


class TextStream:
    """The text a growing list of token ids adds at each step, decoded as a whole each time so
    multi-token characters come out right (an incomplete one, U+FFFD at the end, is held back),
    cut before the first stop string. A character still incomplete when the generation ends
    (cut by max_tokens or a stop token) is dropped, as vLLM's incremental detokenizer drops it:
    its U+FFFD stands for bytes that never came, not for text the model wrote. (Like vLLM, a
    U+FFFD at the very end is always taken for one.)"""

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode = decode  # ids -> text
        self.stop = stop
        self.matcher = StopMatcher(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False

    def push(self, token: int) -> str:
        """The new text after `token`; sets `stopped` when a stop string appeared."""
        self.ids.append(token)
        text = self.decode(self.ids)
        cut, hold = self.matcher.find(text, self.sent)
        if cut >= 0:
            self.stopped = True
            end = cut
        elif text.endswith("\ufffd"):
            return ""
        else:  # hold back a tail that may be the start of a stop string
            end = len(text) - hold
        new = text[self.sent:end]
        self.sent = max(self.sent, end)
        return new

    def flush(self) -> str:
        """What was held back, at the end of the generation (no stop string came)."""
        if self.stopped:
            return ""
        text = self.decode(self.ids).rstrip("\ufffd")
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new

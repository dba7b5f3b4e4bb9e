"""One generation's grammar ahead of the model (docs/design.md#structured-output): a
`TokenConstraint` is llguidance's matcher for one generation, made by `Grammars`
(generation/grammar.py) from a compiled constraint. The mask for the next step is computed on
a worker thread while that step's call runs (the token it depends on is known when the call is
queued), and applied to the call's logits before any sampling: greedy, temperature, top-k and
top-p see only the tokens the grammar allows. The generation's end tokens (EOS, stop token ids)
are allowed exactly when the grammar accepts what was written. The tokens the grammar forces
are queued; a verify row's drafts are accepted under the masks."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .parameters import SamplingError

class GrammarObserver:
    """What the grammar engine reports (triton/model_metrics.py shows it as metrics); every
    method a no-op here. `masked` is called on the worker thread."""

    def constrained(self, kind: str) -> None:
        """A generation started under a `kind` constraint."""

    def compiled(self, kind: str, seconds: float) -> None:
        """A constraint compiled (not found in the cache)."""

    def cache_hit(self, kind: str) -> None:
        """A constraint found compiled."""

    def masked(self, seconds: float) -> None:
        """One step's mask computed."""

    def forced(self, tokens: int) -> None:
        """`tokens` forced by the grammar were taken, to be emitted without a choice."""

    def waited(self, seconds: float) -> None:
        """The choosing thread waited for a mask still computing (not hidden by the call)."""


# How llguidance names its item limit reached while it computes forced ("fast-forward") tokens
FORCED_PAST_LIMIT = "ff_tokens"


def first_line(reason: str) -> str:
    """A refusal's reason as one line of at most 500 characters."""
    return reason.strip().splitlines()[0][:500] if reason.strip() else "refused"


class GrammarFailed(SamplingError):
    """The grammar went past a limit (PARSER_LIMITS) at a step: llguidance's matcher is in
    its error state for good. The generation ends with this reason (INVALID_ARGUMENT: the
    request's grammar, not the server, is at fault)."""

    def __init__(self, reason: str):
        self.reason = first_line(reason)
        super().__init__(f"sampling parameter structured_output: the grammar failed at this "
                         f"step: {self.reason}")


class TokenConstraint:
    """One generation's grammar state, ahead of what the model has been fed.

    When the grammar forces what comes next (`{"name` after an object opens, `"}` closing
    one), it takes those tokens at once (llguidance's canonical tokens of the forced bytes,
    leaving out a last piece a longer token could still extend): they wait in `queued`, and
    the next tokens are those, whatever the model's logits say; a loop may feed them several
    in one call (fast-forward) or one a step, and the ids are the same. Once the queue is
    empty the model chooses: `masked(logits)` applies the mask for that choice (computed on a
    worker thread while the call runs). `took(tokens)` records the tokens that came next (from
    the queue, or chosen), takes what the grammar then forces and starts the next mask.
    `complete`: the grammar takes nothing more (after the queue, only an end may follow), or,
    with `failure` set, its parser can take no more: a grammar that never ends (`start: "ab"
    start`) forces more tokens than llguidance's item limit lets it take at once; the tokens it
    computed are queued (about 25,000 of "ab", more than a context holds), so the generation
    ends by length before they run out, and with `failure` if they do.

    The matcher is touched by one thread at a time: the loop's thread (after the pending mask
    is done) or the worker (computing a mask, or cutting drafts that arrive from another
    thread: `cut` runs there)."""

    def __init__(self, matcher, vocab: int, stops: set[int], worker: ThreadPoolExecutor,
                 grammar_ends: list[int] = (), observer: GrammarObserver | None = None,
                 forced: list[int] | None = None, failure: str | None = None):
        """`stops`: the generation's end ids; `grammar_ends`: the ids llguidance allows
        when the grammar accepts (the tokenizer's EOS), refused here unless they end this
        generation (ignore_eos). `forced`: the matcher has taken these forced tokens already
        (a compiled constraint's first state, with its `failure`); None: it has not looked."""
        self.matcher, self.vocab, self.worker = matcher, vocab, worker
        self.observer = observer or GrammarObserver()
        self.stops = np.array(sorted(t for t in stops if 0 <= t < vocab), np.int64)
        self.not_ends = np.array(sorted(t for t in set(grammar_ends) - set(stops)
                                        if 0 <= t < vocab), np.int64)
        self.queued: list[int] = []  # forced tokens the grammar took, not yet come next
        self._pending: Future | None = None
        self.complete = False
        self.failure: GrammarFailed | None = None  # the parser can take no more (see above)
        if forced is None:
            self._take_forced()
        else:
            self._queue_forced(list(forced), None if failure is None else GrammarFailed(failure))

    def _compute(self) -> np.ndarray:
        import llguidance.numpy as llnp

        t0 = time.perf_counter()
        bits = llnp.allocate_token_bitmask(1, self.vocab)
        llnp.fill_next_token_bitmask(self.matcher, bits)
        if self.matcher.is_error():
            raise GrammarFailed(self.matcher.get_error())
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab]
        allowed = allowed.astype(bool)
        # The generation's end tokens: exactly when what was written is a whole answer.
        allowed[self.stops] = self.matcher.is_accepting()
        allowed[self.not_ends] = False
        self.observer.masked(time.perf_counter() - t0)
        return allowed

    def _idle(self) -> None:
        """Wait until the worker is done with the matcher."""
        if self._pending is not None:
            self._pending.result()

    def _take_forced(self) -> None:
        """Queue what the grammar now forces, and start the mask of the choice after it."""
        self._idle()
        forced = [int(t) for t in self.matcher.compute_ff_tokens()]
        if self.matcher.is_error():
            raise GrammarFailed(self.matcher.get_error())
        failure = None
        if forced and not self.matcher.consume_tokens(forced):
            error = self.matcher.get_error()
            if FORCED_PAST_LIMIT not in error:  # a limit at this step: the grammar's fault
                raise GrammarFailed(error)
            # The run of forced tokens is longer than llguidance's item limit lets the parser
            # take (it counts them again when it takes them): they are what comes next all
            # the same (computed whole), and the parser takes nothing after them.
            failure = GrammarFailed(error)
        self._queue_forced(forced, failure)

    def _queue_forced(self, forced: list[int], failure: "GrammarFailed | None") -> None:
        if forced:
            self.queued += forced
            self.observer.forced(len(forced))
        self.failure = failure
        # Whether the grammar takes nothing more: once the queue is out, the answer is whole
        # and only an end may follow (a loop ends the generation by stop without asking the
        # model), or, after a failure, nothing. Read here: the matcher is the worker's while
        # it computes.
        self.complete = failure is not None or self.matcher.is_stopped()
        self._pending = None if self.complete else self.worker.submit(self._compute)

    def ended(self) -> None:
        """The queue of a complete constraint is out: the answer is whole, or GrammarFailed
        when the parser stopped at its limit before the grammar's end."""
        if self.failure is not None:
            raise self.failure

    def allowed(self) -> np.ndarray:
        """A bool per token id: those the grammar lets the model choose next (once the queue
        is out)."""
        if self._pending is None:  # complete: only the generation's end ids
            self.ended()
            allowed = np.zeros(self.vocab, bool)
            allowed[self.stops] = True
            return allowed
        if not self._pending.done():
            t0 = time.perf_counter()
            self._pending.result()
            self.observer.waited(time.perf_counter() - t0)
        return self._pending.result()

    def masked(self, logits: np.ndarray, allowed: np.ndarray | None = None
               ) -> np.ndarray | None:
        """The logits with every token the grammar refuses at -inf (a new array); ids past
        the tokenizer's vocabulary (a model's padded rows) are refused too. None when it
        refuses every token: the answer is complete and no end id is left to end it with
        (the generation ends by stop). `allowed`: a mask other than the pending one. The
        choice it masks is the one after the queue."""
        logits = np.asarray(logits, np.float32).reshape(-1)
        allowed = self.allowed() if allowed is None else allowed
        if logits.size != allowed.size:
            allowed = np.pad(allowed[:logits.size], (0, max(0, logits.size - allowed.size)))
        if not allowed.any():
            return None
        return np.where(allowed, logits, np.float32(-np.inf))

    def took(self, tokens: list[int]) -> None:
        """`tokens` came next: the queued ones first, then tokens chosen under the masks
        (which the grammar moves past). After a chosen one, what the grammar then forces is
        queued and the next mask starts computing."""
        chosen = False
        for token in tokens:
            token = int(token)
            if self.queued:
                if token != self.queued[0]:
                    raise RuntimeError(f"the grammar forced token {self.queued[0]} next, "
                                       f"not {token}")
                del self.queued[0]
                continue
            # The first chosen token was chosen under the pending mask; later ones (drafts
            # that stood) were cut to what the grammar allows
            self._advance(token, None if chosen or self._pending is None
                          else self._pending.result())
            chosen = True
        if chosen:
            self._take_forced()

    def _advance(self, token: int, allowed: np.ndarray | None = None) -> None:
        self._idle()
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error()
            if allowed is not None and not allowed[token]:  # the loop ignored its mask
                raise RuntimeError(f"the grammar refused token {token}, which its mask "
                                   f"refused: {error}")
            # Allowed, and refused when taken: the step went past a limit
            raise GrammarFailed(f"the grammar refused token {token}: {error}")

    def cut(self, drafts: list[int]) -> list[int]:
        """The longest start of `drafts` the grammar allows after the queue (speculation's
        drafts, checked before the verify call). Runs on the worker, after its mask."""
        if not drafts:
            return []
        n = self.worker.submit(self.matcher.validate_tokens, [int(t) for t in drafts]).result()
        return list(drafts[:n])

    def accept(self, position_logits: np.ndarray, drafts: list[int],
               rule: Callable[[Any, list[int]], tuple[int, int]]) -> tuple[int, int]:
        """Which of a verify row's drafts (fed after the queue) stand under the grammar, and
        the token after them. `rule(position_logits, drafts) -> (stood, following)` is the
        rule without a grammar (greedy or sampled acceptance); it is given each position's
        logits masked in the grammar's state after the drafts before it, so a draft stands
        only where the grammar allows it and the following token is one it allows (-1 when
        it allows none: the answer is complete). The grammar is left where it was: `took`
        moves it past what came next."""
        positions = _MaskedPositions(self, position_logits, drafts)
        try:
            stood, following = rule(positions, drafts)
        except _NothingAllowed as e:
            stood, following = e.position, -1
        assert positions.taken == stood, (positions.taken, stood)
        if stood and not self.matcher.rollback(stood):
            raise RuntimeError(f"the grammar cannot go back {stood} tokens: "
                               f"{self.matcher.get_error()}")
        return stood, following


class _NothingAllowed(Exception):
    def __init__(self, position: int):
        self.position = position


class _MaskedPositions:
    """A verify row's logits after each of its positions (`[drafts + 1, vocab]`), read in
    order, each masked in the grammar's state after the drafts before it: reading position
    i moves the grammar past draft i - 1, which an acceptor reads only once it stood."""

    def __init__(self, constraint: TokenConstraint, logits: np.ndarray, drafts: list[int]):
        self.constraint, self.logits, self.drafts = constraint, logits, drafts
        self.taken = 0  # drafts the grammar moved past

    def __getitem__(self, i: int) -> np.ndarray:
        c = self.constraint
        assert self.taken <= i <= len(self.drafts), (self.taken, i)
        allowed = None  # position 0: the pending mask
        if i > 0:
            while self.taken < i:
                c._advance(self.drafts[self.taken])
                self.taken += 1
            allowed = c._compute()
        row = c.masked(self.logits[i], allowed)
        if row is None:
            raise _NothingAllowed(i)
        return row


__all__ = ["FORCED_PAST_LIMIT", "GrammarFailed", "GrammarObserver", "TokenConstraint",
           "first_line"]

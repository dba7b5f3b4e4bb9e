"""The grammar engine (docs/design.md#structured-output): a request's `structured_output`
(generation/structured.py) enforced token by token where the next token is chosen.

- `Grammars`: one model's grammar compiler. llguidance builds its token trie from the artifact's
  tokenizer.json (once, on first use) and compiles each constraint; compiled grammars are kept
  by content in a bounded LRU, so a repeated schema costs nothing. A constraint llguidance
  cannot compile is refused with its reason (`SamplingError`: INVALID_ARGUMENT, before the
  generation takes a page).
- `TokenConstraint`: one generation's matcher. The mask for the next step is computed on a
  worker thread while that step's call runs (the token it depends on is known when the call is
  queued), and applied to the call's logits before any sampling: greedy, temperature, top-k and
  top-p see only the tokens the grammar allows. The generation's end tokens (EOS, stop token
  ids) are allowed exactly when the grammar accepts what was written.

Why llguidance: one abi3 wheel with no required dependencies, a tokenizer read from
tokenizer.json text (no transformers in the serving path), JSON schema, regex, Lark and GBNF in
one engine, a whole vocabulary's mask in microseconds (an Earley parser over a token trie, with
no per-vocabulary precompilation per grammar, which is what outlines-core spends seconds on for
a large schema), and rollback and forced ("fast-forward") tokens for speculation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .parameters import SamplingError
from .structured import StructuredOutput

log = logging.getLogger("triton_tlaloc.structured")

CACHE_SIZE = 256  # compiled grammars kept by content
# llguidance's bounds on the work one grammar may cost (its defaults, stated here so they are
# ours): the compile's lexer fuel (about 50k a ms: 20 ms), the grammar's symbols, and a mask
# step's lexer fuel (about 14k a ms) and Earley items (about 20k a ms), a few ms, under a
# decode call. A grammar past them at compile or at its first step is refused by name; one
# past them later ends its generation with that reason.
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=500_000,
                     max_items_in_row=2000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_lexer_states=250_000)


def llguidance_grammar(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec` (not yet checked)."""
    import llguidance

    if spec.kind in ("json_schema", "json_object"):
        # Compact JSON (no whitespace between tokens): nothing to spend tokens on, and no
        # run of blank lines for a model to stay in; every separator is forced.
        options = {"whitespace_flexible": False, "lenient": not spec.strict}
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    return llguidance.grammar_from("grammar", spec.text)  # Lark or GBNF


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


class Grammars:
    """A model's grammar compiler over its tokenizer: `constraint(spec, stops)` gives a
    generation its TokenConstraint or refuses the spec by name. Thread-safe (the link's
    reader threads compile; the batching thread never does)."""

    def __init__(self, tokenizer_dir: Path | None, vocab: int, eos: list[int],
                 cache_size: int = CACHE_SIZE, observer: GrammarObserver | None = None):
        self.tokenizer_dir, self.vocab, self.eos = tokenizer_dir, vocab, list(eos)
        self.cache_size = cache_size
        self.observer = observer or GrammarObserver()
        self._tokenizer = None
        self._limits = None  # llguidance's LLParserLimits, made on first use
        self._compiled: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = self.cache_hits = 0
        # One worker computes every generation's next mask while the call runs (llguidance
        # releases the GIL while it computes).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tlaloc-grammar")

    def tokenizer(self):
        """llguidance's tokenizer, built on first use (about 0.3 s for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                path = self.tokenizer_dir / "tokenizer.json" if self.tokenizer_dir else None
                if path is None or not path.is_file():
                    raise SamplingError("sampling parameter structured_output: this model's "
                                        "artifact has no tokenizer.json to constrain with")
                t0 = time.perf_counter()
                try:
                    self._tokenizer = llguidance.LLTokenizer(path.read_text(encoding="utf-8"),
                                                             n_vocab=self.vocab,
                                                             eos_token=self.eos or None)
                except Exception as e:  # the generation is refused, the link reads on
                    log.warning("structured output: llguidance cannot read %s: %s", path, e)
                    raise SamplingError(f"sampling parameter structured_output: llguidance "
                                        f"cannot read this model's tokenizer: {e}") from None
                log.info("structured output: llguidance's tokenizer built in %.2f s "
                         "(%d tokens)", time.perf_counter() - t0, self.vocab)
                # Errors name the limit, not the parser's state
                self._limits = llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)
            return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The compiled grammar of `spec` (cached by content), or SamplingError with
        llguidance's reason."""
        key = (spec.kind, spec.text, spec.strict)
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None:
                self._compiled.move_to_end(key)
                self.cache_hits += 1
        if grammar is not None:
            self.observer.cache_hit(spec.kind)
            return grammar
        import llguidance

        tokenizer = self.tokenizer()
        t0 = time.perf_counter()
        try:
            grammar = llguidance_grammar(spec)
        except (ValueError, TypeError) as e:
            raise _refused(spec, str(e)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=self._limits)
        seconds = time.perf_counter() - t0
        if is_error:
            raise _refused(spec, messages[0] if messages else "llguidance refused it")
        if spec.strict and messages and spec.kind == "json_schema":
            # An unimplemented keyword is a warning to llguidance; under strict it would leave
            # part of the schema unenforced, so it is refused.
            raise _refused(spec, "; ".join(messages))
        with self._lock:
            self.compiles += 1
            self._compiled[key] = grammar
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        log.info("structured output: a %s compiled in %.1f ms", spec.kind, seconds * 1e3)
        self.observer.compiled(spec.kind, seconds)
        return grammar

    def constraint(self, spec: StructuredOutput, stops: set[int]) -> "TokenConstraint":
        """A new generation's constraint (the tokens its grammar forces first queued, its
        first mask computed). A grammar that fails its first step (past PARSER_LIMITS, which
        compiling does not see) is refused here, before the generation takes a page."""
        import llguidance

        tokenizer = self.tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, self.grammar(spec), limits=self._limits)
        if matcher.is_error():
            raise _refused(spec, matcher.get_error())
        try:
            constraint = TokenConstraint(matcher, self.vocab, stops, self._worker, self.eos,
                                         self.observer)
            constraint._idle()  # its first mask: whether the grammar fails at it
        except GrammarFailed as e:
            raise _refused(spec, e.reason) from None
        self.observer.constrained(spec.kind)
        return constraint

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _first_line(reason: str) -> str:
    return reason.strip().splitlines()[0][:500] if reason.strip() else "refused"


def _refused(spec: StructuredOutput, reason: str) -> SamplingError:
    return SamplingError(f"sampling parameter structured_output.{spec.kind}: "
                         f"{_first_line(reason)}")


class GrammarFailed(SamplingError):
    """The grammar went past a limit (PARSER_LIMITS) at a step: llguidance's matcher is in
    its error state for good. The generation ends with this reason (INVALID_ARGUMENT: the
    request's grammar, not the server, is at fault)."""

    def __init__(self, reason: str):
        self.reason = _first_line(reason)
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
    `complete`: the grammar takes nothing more (after the queue, only an end may follow).

    The matcher is touched by one thread at a time: the loop's thread (after the pending mask
    is done) or the worker (computing a mask, or cutting drafts that arrive from another
    thread: `cut` runs there)."""

    def __init__(self, matcher, vocab: int, stops: set[int], worker: ThreadPoolExecutor,
                 grammar_ends: list[int] = (), observer: GrammarObserver | None = None):
        """`stops`: the generation's end ids; `grammar_ends`: the ids llguidance allows
        when the grammar accepts (the tokenizer's EOS), refused here unless they end this
        generation (ignore_eos)."""
        self.matcher, self.vocab, self.worker = matcher, vocab, worker
        self.observer = observer or GrammarObserver()
        self.stops = np.array(sorted(t for t in stops if 0 <= t < vocab), np.int64)
        self.not_ends = np.array(sorted(t for t in set(grammar_ends) - set(stops)
                                        if 0 <= t < vocab), np.int64)
        self.queued: list[int] = []  # forced tokens the grammar took, not yet come next
        self._pending: Future | None = None
        self.complete = False
        self._take_forced()

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
        if forced:  # a grammar takes its own forced tokens unless a limit stops it
            self.matcher.consume_tokens(forced)
        if self.matcher.is_error():
            raise GrammarFailed(self.matcher.get_error())
        if forced:
            self.queued += forced
            self.observer.forced(len(forced))
        # Whether the grammar takes nothing more: once the queue is out, the answer is whole
        # and only an end may follow (a loop ends the generation by stop without asking the
        # model). Read here: the matcher is the worker's while it computes.
        self.complete = self.matcher.is_stopped()
        self._pending = None if self.complete else self.worker.submit(self._compute)

    def allowed(self) -> np.ndarray:
        """A bool per token id: those the grammar lets the model choose next (once the queue
        is out)."""
        if self._pending is None:  # complete: only the generation's end ids
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


__all__ = ["CACHE_SIZE", "GrammarFailed", "GrammarObserver", "Grammars", "PARSER_LIMITS",
           "TokenConstraint", "llguidance_grammar"]

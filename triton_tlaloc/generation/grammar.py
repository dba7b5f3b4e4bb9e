"""The grammar engine (docs/design.md#structured-output): a request's `structured_output`
(generation/structured.py) enforced token by token where the next token is chosen.

- `Grammars`: one model's grammar compiler. llguidance builds its token trie from the artifact's
  tokenizer.json (once, on first use) and compiles each constraint on compile threads of its
  own, off every thread a generation's steps wait on, within a time limit and a bounded queue;
  compiled constraints (and refusals) are kept by content in bounded LRUs, so a repeated schema
  costs a copy. A constraint llguidance cannot compile, or not in time, is refused with its
  reason (`SamplingError`: INVALID_ARGUMENT), before the generation's START is sent and takes a
  page.
- each generation gets its own matcher as a `TokenConstraint` (generation/token_constraint.py).

Why llguidance: one abi3 wheel with no required dependencies, a tokenizer read from
tokenizer.json text (no transformers in the serving path), JSON schema, regex, Lark and GBNF in
one engine, a whole vocabulary's mask in microseconds (an Earley parser over a token trie, with
no per-vocabulary precompilation per grammar, which is what outlines-core spends seconds on for
a large schema), and rollback and forced ("fast-forward") tokens for speculation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable


from .parameters import SamplingError
from .structured import StructuredOutput
from .token_constraint import GrammarFailed, GrammarObserver, TokenConstraint, first_line

log = logging.getLogger("triton_tlaloc.structured")

CACHE_SIZE = 32  # compiled constraints kept by content (a large schema's: up to ~15 MB)
REFUSALS_KEPT = 256  # refused constraints kept by content, each its reason
# The compiles: threads of their own (llguidance releases the GIL while it compiles), how many
# may wait for one, and how long one may wait and then run. Measured on SmolLM2's tokenizer,
# one core of this project's 2-core machine: a 58 KB regex alternation or a 900-property
# schema 0.1 s; the slowest schemas are small ones that multiply out (`allOf` of `anyOf`s):
# 1.3 s for the largest llguidance takes, 1.65 s for one it refuses at its symbol limit
# (3.7 s with the other core busy), past which its "schema too large" check refuses at once.
COMPILE_THREADS = 2
COMPILE_WAITING = 64
COMPILE_SECONDS = 3.0
# A compile thread runs at a lower scheduling priority than the threads that serve (Linux
# gives each thread its own nice value): on cores the model's calls keep busy, compiles take
# the time the calls leave rather than slowing every generation's steps.
COMPILE_NICENESS = 10
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


class GrammarsBusy(Exception):
    """Every compile thread is taken and the compiles waiting are as many as allowed, or one
    waited its whole COMPILE_SECONDS for a thread: the generation is refused (UNAVAILABLE),
    as a full pool refuses one; the grammar itself is not at fault."""


class CompileTicket:
    """One generation's wait for its constraint (`Grammars.prepare`): its `done(constraint,
    error)` is called once, or never if `cancel()` took the ticket back first."""

    def __init__(self, grammars: "Grammars", stops: set[int],
                 done: Callable[["TokenConstraint | None", Exception | None], None]):
        self.grammars, self.stops, self.done = grammars, set(stops), done
        self.job: _Job | None = None
        self.answered = False  # under the grammars' lock: done is (or was) being called

    def cancel(self) -> bool:
        """Whether the ticket was taken back before its answer: `done` is then never called,
        and a compile no other ticket waits for is dropped before it starts."""
        return self.grammars._withdraw(self)


class _Job:
    """A compile: the tickets waiting for it (every generation asking for the same constraint
    meanwhile), when it was queued and when a thread took it; `over`: past its deadline,
    its tickets answered, left to end."""

    def __init__(self, key: tuple, spec: StructuredOutput, now: float):
        self.key, self.spec, self.queued_at = key, spec, now
        self.started_at: float | None = None
        self.tickets: list[CompileTicket] = []
        self.over = False


class _Compiled:
    """A compiled constraint in its first state: the matcher past the tokens the grammar
    forces first, those tokens, and the failure that cut them short (a grammar that never
    ends), copied for each generation."""

    def __init__(self, matcher, forced: list[int], failure: str | None):
        self.matcher, self.forced, self.failure = matcher, forced, failure


class _Inline:
    """An executor that runs what it is given at once (a compile's first mask, on its own
    thread)."""

    @staticmethod
    def submit(fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future


class Grammars:
    """A model's grammar compiler over its tokenizer. `prepare(spec, stops, done)` hands a
    generation its TokenConstraint, or the reason it is refused, through `done`; it never
    compiles on the caller's thread. `constraint(spec, stops)` waits for it (a thread of the
    generation's own: the BLS loop, tests).

    Compiles run on COMPILE_THREADS threads of their own (llguidance releases the GIL while it
    compiles, so a thread is enough: nothing else waits for them), at most COMPILE_WAITING
    wait for one, and each has COMPILE_SECONDS to start and as many to finish: a compile past
    it is refused by name (INVALID_ARGUMENT; the compile goes on to its end and what it gives
    is kept, so a retry finds it compiled); one that waited that long for a thread, or found
    the queue full, is refused as busy (UNAVAILABLE). A generation asking for a constraint
    that is compiling waits for that compile; a compile whose generations were all cancelled
    first is dropped before it starts. A compile
    already running cannot be stopped: llguidance's own limits end it (PARSER_LIMITS, its JSON
    schema size and symbol checks; see COMPILE_SECONDS), and its thread is taken until then.
    What a constraint compiled to is cached by content, and so is llguidance's refusal, so a
    repeated one costs a copy."""

    def __init__(self, tokenizer_dir: Path | None, vocab: int, eos: list[int],
                 cache_size: int = CACHE_SIZE, observer: GrammarObserver | None = None,
                 threads: int = COMPILE_THREADS, waiting: int = COMPILE_WAITING,
                 compile_seconds: float = COMPILE_SECONDS):
        self.tokenizer_dir, self.vocab, self.eos = tokenizer_dir, vocab, list(eos)
        self.cache_size, self.threads, self.waiting = cache_size, threads, waiting
        self.compile_seconds = compile_seconds
        self.observer = observer or GrammarObserver()
        self._tokenizer = None
        self._limits = None  # llguidance's LLParserLimits, made on first use
        self._tokenizer_lock = threading.Lock()
        self._compiled: OrderedDict[tuple, _Compiled] = OrderedDict()
        self._refused: OrderedDict[tuple, str] = OrderedDict()
        self._jobs: dict[tuple, _Job] = {}  # compiles queued or running, by content
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._started: list[threading.Thread] = []
        self._closed = False
        self.compiles = self.cache_hits = 0
        # One worker computes every generation's next mask while the call runs (llguidance
        # releases the GIL while it computes).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tlaloc-grammar")

    def tokenizer(self):
        """llguidance's tokenizer, built on first use (about 0.3 s for a 49k vocabulary)."""
        with self._tokenizer_lock:
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

    # ------------------------------------------------------------ a generation's constraint

    def prepare(self, spec: StructuredOutput, stops: set[int],
                done: Callable[["TokenConstraint | None", Exception | None], None]
                ) -> CompileTicket:
        """Hands `done(constraint, None)` the generation's constraint (the tokens its grammar
        forces first queued), or `done(None, error)`: SamplingError naming why the constraint
        is refused (INVALID_ARGUMENT), or GrammarsBusy. A constraint found compiled (or
        refused) is answered here, on the caller's thread, at the cost of a copy; else
        `done` is called from a compile thread (or the deadline's)."""
        ticket = CompileTicket(self, stops, done)
        key = (spec.kind, spec.text, spec.strict)
        now = time.monotonic()
        with self._cv:
            compiled, refusal, busy = self._compiled.get(key), self._refused.get(key), None
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.cache_hits += 1
            elif refusal is None:
                job = self._jobs.get(key)
                if job is not None and job.over:  # compiling past its deadline still
                    refusal = _too_slow(spec, self.compile_seconds).reason
                elif job is None and self._closed:
                    busy = GrammarsBusy("structured_output: the grammar engine is closing")
                elif job is None and len(self._queue) >= self.waiting:
                    busy = GrammarsBusy(f"structured_output: {len(self._queue)} constraints "
                                        f"wait to compile, as many as may: try again")
                elif job is None:
                    job = self._jobs[key] = _Job(key, spec, now)
                    self._queue.append(job)
                    self._start_threads()
                    self._cv.notify_all()
                if busy is None and refusal is None:
                    job.tickets.append(ticket)
                    ticket.job = job
            if compiled is not None or refusal is not None or busy is not None:
                ticket.answered = True
        if compiled is not None:
            self.observer.cache_hit(spec.kind)
            self._deliver(ticket, spec, compiled, None)
        elif refusal is not None:
            self._deliver(ticket, spec, None, _refused(spec, refusal))
        elif busy is not None:
            self._deliver(ticket, spec, None, busy)
        return ticket

    def constraint(self, spec: StructuredOutput, stops: set[int]) -> "TokenConstraint":
        """`prepare`'s answer, waited for: the constraint, or its refusal raised."""
        answered = threading.Event()
        box: list = []

        def done(constraint, error):
            box[:] = [constraint, error]
            answered.set()
        self.prepare(spec, stops, done)
        answered.wait()
        constraint, error = box
        if error is not None:
            raise error
        return constraint

    def _deliver(self, ticket: CompileTicket, spec: StructuredOutput,
                 compiled: _Compiled | None, error: Exception | None) -> None:
        """`ticket`'s answer: its generation's constraint, a copy of `compiled`."""
        constraint = None
        if error is None:
            try:
                constraint = TokenConstraint(compiled.matcher.deep_copy(), self.vocab,
                                             ticket.stops, self._worker, self.eos,
                                             self.observer, forced=compiled.forced,
                                             failure=compiled.failure)
                self.observer.constrained(spec.kind)
            except Exception as e:  # (the mask worker shut down: the model is unloading)
                log.warning("structured output: a constraint could not be made: %s", e)
                error = GrammarsBusy(f"structured_output: {type(e).__name__}: {e}")
        try:
            ticket.done(constraint, error)
        except Exception:  # one generation's failure must not take a compile thread down
            log.exception("structured output: a constraint's answer failed")

    def _withdraw(self, ticket: CompileTicket) -> bool:
        with self._cv:
            if ticket.answered:
                return False
            ticket.answered = True
            job = ticket.job
            job.tickets.remove(ticket)
            if not job.tickets and job.started_at is None:  # nobody waits: never compiled
                self._queue.remove(job)
                del self._jobs[job.key]
            return True

    # ------------------------------------------------------------ the compile threads

    def _start_threads(self) -> None:
        """(under the lock) The compile threads and the deadline's, on first use."""
        if self._started:
            return
        for i in range(self.threads):
            self._started.append(threading.Thread(target=self._compile_loop, daemon=True,
                                                  name=f"tlaloc-grammar-compile-{i}"))
        self._started.append(threading.Thread(target=self._deadlines, daemon=True,
                                              name="tlaloc-grammar-deadline"))
        for t in self._started:
            t.start()

    def _compile_loop(self) -> None:
        _lower_priority(COMPILE_NICENESS)
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.started_at = time.monotonic()
                self._cv.notify_all()  # its deadline moved
            try:
                compiled, refusal = self._compile(job.spec), None
            except SamplingError as e:
                compiled, refusal = None, e
            except Exception as e:  # never leave a ticket unanswered
                log.exception("structured output: compiling a %s failed", job.spec.kind)
                compiled, refusal = None, _refused(job.spec, f"{type(e).__name__}: {e}")
            seconds = time.monotonic() - job.started_at
            with self._cv:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                if job.over:  # its generations were answered at its deadline
                    log.info("structured output: a %s compiled in %.1f s, past its %g s: "
                             "kept for the next that asks", job.spec.kind, seconds,
                             self.compile_seconds)
                if compiled is not None:
                    self.compiles += 1
                    self._compiled[job.key] = compiled
                    while len(self._compiled) > self.cache_size:
                        self._compiled.popitem(last=False)
                else:
                    self._refuse(job.key, refusal)
                tickets, job.tickets = job.tickets, []
                for t in tickets:
                    t.answered = True
                if compiled is not None:  # those that waited for it after the first: hits
                    self.cache_hits += max(0, len(tickets) - 1)
            if compiled is not None:
                log.info("structured output: a %s compiled in %.1f ms", job.spec.kind,
                         seconds * 1e3)
                self.observer.compiled(job.spec.kind, seconds)
            for i, t in enumerate(tickets):
                if i and compiled is not None:
                    self.observer.cache_hit(job.spec.kind)
                self._deliver(t, job.spec, compiled, refusal)

    def _refuse(self, key: tuple, refusal: SamplingError) -> None:
        """(under the lock) `key`'s constraint refused from now on, for `refusal`'s reason
        (llguidance's: a compile past its deadline is not, its result is kept)."""
        self._refused[key] = getattr(refusal, "reason", str(refusal))
        while len(self._refused) > REFUSALS_KEPT:
            self._refused.popitem(last=False)

    def _deadlines(self) -> None:
        """Answers the tickets of a compile past its deadline: COMPILE_SECONDS waiting for a
        thread (busy), or as long compiling (refused; the compile ends by itself, its result
        kept: until then the constraint is refused at once, then found compiled)."""
        while True:
            answers = []
            with self._cv:
                while True:
                    if self._closed:
                        return
                    now, due = time.monotonic(), None
                    for job in list(self._jobs.values()):
                        if job.over:
                            continue
                        deadline = (job.started_at or job.queued_at) + self.compile_seconds
                        if now < deadline:
                            due = deadline if due is None else min(due, deadline)
                            continue
                        if job.started_at is None:
                            self._queue.remove(job)
                            del self._jobs[job.key]
                            error = GrammarsBusy(
                                f"structured_output: no compile thread free within "
                                f"{self.compile_seconds:g} s: try again")
                        else:
                            job.over = True
                            error = _too_slow(job.spec, self.compile_seconds)
                        for t in job.tickets:
                            t.answered = True
                            answers.append((t, job.spec, error))
                        job.tickets = []
                    if answers:
                        break
                    self._cv.wait(None if due is None else due - now)
            for ticket, spec, error in answers:
                self._deliver(ticket, spec, None, error)

    def _compile(self, spec: StructuredOutput) -> _Compiled:
        """`spec` compiled (on a compile thread), and its first step taken: the tokens it
        forces first and its first mask, which some grammars fail (past PARSER_LIMITS, which
        compiling does not see). SamplingError with llguidance's reason when it is refused."""
        import llguidance

        tokenizer = self.tokenizer()
        try:
            grammar = llguidance_grammar(spec)
        except (ValueError, TypeError) as e:
            raise _refused(spec, str(e)) from None
        # Compiles once (llguidance's validate_grammar would compile it a second time)
        matcher = llguidance.LLMatcher(tokenizer, grammar, limits=self._limits)
        if matcher.is_error():
            raise _refused(spec, matcher.get_error() or "llguidance refused it")
        warnings = matcher.get_grammar_warnings()
        if spec.strict and warnings and spec.kind == "json_schema":
            # An unimplemented keyword is a warning to llguidance; under strict it would leave
            # part of the schema unenforced, so it is refused.
            raise _refused(spec, "; ".join(warnings))
        try:
            first = TokenConstraint(matcher, self.vocab, set(), _Inline())
            first._idle()  # its first mask, here
        except GrammarFailed as e:
            raise _refused(spec, e.reason) from None
        return _Compiled(first.matcher, list(first.queued),
                         None if first.failure is None else first.failure.reason)

    def close(self) -> None:
        """Compile threads end once their compile does; what waits is answered as busy."""
        with self._cv:
            self._closed = True
            waiting = [(t, job.spec) for job in self._jobs.values() for t in job.tickets]
            for job in self._jobs.values():
                job.over = True
                for t in job.tickets:
                    t.answered = True
                job.tickets = []
            self._jobs.clear()
            self._queue.clear()
            self._cv.notify_all()
        for ticket, spec in waiting:
            self._deliver(ticket, spec, None, GrammarsBusy(
                "structured_output: the grammar engine is closing"))
        self._worker.shutdown(wait=False, cancel_futures=True)


def _refused(spec: StructuredOutput, reason: str) -> SamplingError:
    error = SamplingError(f"sampling parameter structured_output.{spec.kind}: "
                          f"{first_line(reason)}")
    error.reason = first_line(reason)
    return error


def _too_slow(spec: StructuredOutput, seconds: float) -> SamplingError:
    return _refused(spec, f"took more than {seconds:g} s to compile (the limit of a "
                          f"constraint's compile)")


def _lower_priority(niceness: int) -> None:
    """This thread's nice value raised by `niceness` (Linux: per thread); elsewhere nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + niceness)
    except (AttributeError, OSError):
        pass


__all__ = ["CACHE_SIZE", "COMPILE_SECONDS", "COMPILE_THREADS", "COMPILE_WAITING",
           "CompileTicket", "Grammars", "GrammarsBusy", "PARSER_LIMITS",
           "llguidance_grammar"]

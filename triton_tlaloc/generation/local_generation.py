"""Generations run inside the sequence model's process
(docs/design.md#generation-inside-the-engine).

The generate model sends each generation here over the local link (generation/generation_link.py)
instead of making a BLS call per token. Each generation is a sequence of the batcher's with a key no
Triton client can send (`LocalSequenceId`). Its reply function runs on the batching thread:
it chooses the next token from the call's logits (greedy, or `Sampler` with the request's
parameters), and queues the sequence's next step at once, so that the next round finds the whole
cohort queued and never waits for it. The tokens chosen in a round go back to the generate
model in one frame, written by the connection's writer thread when the round ends.

Token-level ends are decided here (an end-of-sequence or stop token id, max_tokens, the largest
context); text-level ones (stop strings) by the generate model, which holds the tokenizer and
cancels the generation. Every generation ends with one event carrying its finish reason, and
its sequence is ENDed (kept for a next turn as a client's would be).

Pure Python over a batcher-like object (`submit_group`): no Triton import here, tested with a
fake batcher (tests/unit/test_local_generation.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..scheduling.admission import Reply, Request
from ..codes import INTERNAL, INVALID_ARG, RequestError
from ..model_parameters import default_int
from .logprobs import PromptScoring, logprob_entry
from .penalties import check_token_ids
from .sampling import Sampler, SamplingError, SamplingParams
from .speculative import (DraftModelCost, Speculator, StepCost, best_length,
                          greedy_acceptance, sampled_acceptance)
from .generation_link import LinkError

if TYPE_CHECKING:
    from ..scheduling.observer import BatcherStats
    from .draft_model import DraftClients, ModelDrafter
    from .grammar import Grammars

log = logging.getLogger("triton_tlaloc.local_generation")

NO_TOKEN = -1
# The reason of the event that carries the prompt's log-probabilities (not an end): the
# generation goes on.
PROMPT_LOGPROBS = "prompt_logprobs"


class LocalSequenceId:
    """The batcher's key of a local generation's sequence: compared by identity, so no
    correlation id a client sends (an integer or a string) can equal it."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number

    def __repr__(self) -> str:
        return f"local-{self.number}"


_numbers = itertools.count(1)


class Generation:
    """One generation: its sequence, its sampler, what it generated so far, and whether its
    generate model cancelled it. `emit(event)` hands an event to the connection's outbox;
    `submit(requests)` queues its next requests for the batcher."""

    def __init__(self, gen_id: int, prompt: list[int], params: SamplingParams, stops: set[int],
                 max_context: int, emit: Callable[[list], None],
                 submit: Callable[[list[Request]], None],
                 speculation: "Speculation | None" = None, draft_model: str = "",
                 submit_now: Callable[[list[Request]], None] | None = None,
                 grammars: "Grammars | None" = None, grammar_later: bool = False):
        """`submit` queues the next step when the round ends (from the batching thread);
        `submit_now` hands it to the batcher at once (from another thread: a draft model's
        drafts arriving); `draft_model` names the model a draft_model speculation drafts with;
        `grammars` compiles a structured_output constraint: here, waiting for it, or with
        `grammar_later` not here: the caller sets `constraint` (Grammars.prepare's answer)
        before it sends `start_request()` (the link does, off its reader thread)."""
        assert prompt, "a generation needs a prompt"
        self.gen_id, self.prompt, self.params = gen_id, prompt, params
        self.stops, self.max_context = stops, max_context
        self.emit, self.submit, self.submit_now = emit, submit, submit_now or submit
        self.sampler = Sampler(params, prompt, stops)
        self.seq_id = LocalSequenceId(next(_numbers))
        self.generated = 0
        self.cancelled = False  # set by the link's reader thread, read by the batching thread
        self.finished = False
        self.speculator = self.drafter = self.constraint = None
        self.grammar_ticket = None  # its wait for its constraint (grammar_later)
        self.speculation = speculation or Speculation()  # what fast-forward feeds through
        if self.speculation.vocab:
            check_token_ids(params, self.speculation.vocab)
        self._call_forced = 0  # forced tokens the START fed after the prompt
        self._logprob = None  # the emitted token's (logprobs.logprob_entry), when asked for
        self._entries: list = []  # those of the step's tokens, in order
        self.scoring = None  # the prompt fed a few tokens a step, when its logprobs are asked for
        if params.prompt_logprobs is not None:  # (refused with speculation and grammars)
            spec = self.speculation
            self.scoring = PromptScoring(prompt, params.prompt_logprobs,
                                         1 if spec.refused else spec.most_drafts + 1,
                                         spec.most_scored)
        if params.structured_output is not None:
            if grammars is None:
                raise SamplingError("sampling parameter structured_output: this sequence model "
                                    "has no grammar engine")
            if not grammar_later:
                self.constraint = grammars.constraint(params.structured_output, stops)
        if params.speculative is not None:
            speculation = self.speculation
            if speculation.refused:
                raise SamplingError(f"sampling parameter speculative: {speculation.refused}")
            cost = speculation.cost
            if params.speculative.method == "draft_model":
                self.drafter = speculation.model_drafter(draft_model, prompt, params.cache_salt)
                cost = DraftModelCost(cost or StepCost(), lambda: self.drafter.seconds_per_draft)
            self.speculator = Speculator(params.speculative, prompt, speculation.most_drafts,
                                         cost)

    @property
    def length(self) -> int:
        """The prompt and the tokens generated so far."""
        return len(self.prompt) + self.generated

    def start_request(self) -> Request:
        """The START: the prompt, and the tokens a grammar forces first (`{"` of a JSON
        object) after it, computed in the same call: as many as max_tokens and the context
        leave room for with the token after them (they count as generated ones do), and none
        when the answer ends with them (no logits are needed for them, nor after them)."""
        assert self.params.structured_output is None or self.constraint is not None, \
            "a constrained generation starts once its constraint is made"
        tokens = list(self.prompt)
        if self.scoring is not None:
            tokens = tokens[:1]
        c = self.constraint
        # (with logprobs asked for, forced tokens wait for calls that give their logits)
        if c is not None and self.params.logprobs is None and not c.complete:
            room = min(self.params.max_tokens, self.max_context - len(tokens)) - 1
            self._call_forced = max(0, min(len(c.queued), room))
            tokens += c.queued[:self._call_forced]
        return Request(seq_id=self.seq_id, tokens=tokens, start=True, end=False,
                       reply_fn=self.on_reply, cache_salt=self.params.cache_salt,
                       lora=self.params.lora)

    def on_reply(self, reply: Reply) -> None:
        """The batcher answered a step (on its thread): choose, emit, queue the next step. Any
        failure on the way ends the generation with one error event and ENDs its sequence:
        a generation never goes unanswered, nor its sequence held."""
        if self.finished:  # a reply after the end (its END is queued): nothing to answer
            log.warning("%s: a reply after the generation ended", self.seq_id)
            return
        try:
            self._on_reply(reply)
        except SamplingError as e:  # the request's own (its grammar past a limit)
            log.info("%s: %s", self.seq_id, e)
            if not self.finished:
                self._finish(NO_TOKEN, "error", INVALID_ARG, f"generation {self.gen_id}: {e}")
        except Exception as e:
            log.exception("%s: choosing its next token failed", self.seq_id)
            if not self.finished:
                self._finish(NO_TOKEN, "error", INTERNAL,
                             f"generation {self.gen_id}: {type(e).__name__}: {e}")

    def _on_reply(self, reply: Reply) -> None:
        if reply.error is not None:
            self._finish(NO_TOKEN, "error", reply.code or INTERNAL, reply.error)
            return
        if self.cancelled:
            self._finish(NO_TOKEN, "cancelled")
            return
        if self.scoring is not None and not self.scoring.done:
            if self._scored(reply):
                return
        c = self.constraint
        if reply.accepted_ids is not None:
            # A verify call's: the forced tokens and drafts that stood, then one more.
            tokens = reply.accepted_ids
        elif c is not None:
            tokens = self._next_under_grammar(reply.logits)
        else:
            tokens = [self.sampler.choose(reply.logits)]  # greedy: the argmax
        if self.params.logprobs is not None and reply.accepted_ids is None:
            # (a verify call's were taken by its acceptor, _recording)
            self._entries = [logprob_entry(reply.logits, t, self.params.logprobs)
                             for t in tokens if t != NO_TOKEN]
        self.sampler.took(tokens)
        if self.speculator is not None:
            self.speculator.took(tokens)
        if self.drafter is not None:
            self.drafter.took(tokens)
        if not self._emit(tokens):
            return
        token = tokens[-1]
        if c is not None:
            c.took(tokens)
            if c.complete and (self.params.logprobs is None or not c.queued):
                # What is queued ends the answer: no call to make (with logprobs asked for,
                # the queued tokens are fed first, their logits the entries')
                if self._emit(c.queued):  # (ends by length when they pass a limit)
                    c.ended()  # a parser that stopped short of the grammar's end: its error
                    self._finish(NO_TOKEN, "stop")
                return
            if c.queued:  # the next step feeds forced tokens, and drafts none
                self.submit([self._step(token, c.queued[:self._forced_count()], forced=True)])
                return
        if self.drafter is None:
            self.submit([self._next_step(token)])
            return
        k = 0 if self.drafter.failed else self.speculator.count(self._room())
        if k == 0:
            self.submit([self._step(token, [])])
            return
        self.drafter.ask(k, lambda drafts: self.submit_now(
            [self._step(token, self.speculator.sending(self._cut(drafts[:k])))]))

    def _scored(self, reply: Reply) -> bool:
        """A step of the prompt's scoring answered: whether another is queued (False: the
        prompt is all fed, and `reply`'s logits choose the first token)."""
        scoring = self.scoring
        if reply.accepted_ids is None:  # (a verify step's acceptor took its logits)
            scoring.took_logits(reply.logits)
        if scoring.done:
            self.emit([self.gen_id, NO_TOKEN, PROMPT_LOGPROBS, None, None, scoring.entries])
            return False
        feed = scoring.next_feed()
        if len(feed) == 1:
            self.submit([Request(seq_id=self.seq_id, tokens=feed, start=False, end=False,
                                 reply_fn=self.on_reply)])
        else:
            self.submit([Request(seq_id=self.seq_id, tokens=feed, start=False, end=False,
                                 reply_fn=self.on_reply, draft_tokens=len(feed) - 1,
                                 want_logits=False, acceptor=scoring.accept,
                                 forced_tokens=len(feed) - 1, scoring=True)])
        return True

    def _next_under_grammar(self, logits: np.ndarray) -> list[int]:
        """The tokens after a decode or prompt call under a grammar: the forced tokens it fed
        after its own, then the next forced one, or else the model's choice under the mask
        (NO_TOKEN when the grammar allows none: the answer is complete)."""
        queued, fed = self.constraint.queued, self._call_forced
        self._call_forced = 0
        if len(queued) > fed:
            return queued[:fed + 1]
        logits = self.constraint.masked(logits)
        return queued[:fed] + [NO_TOKEN if logits is None else self.sampler.choose(logits)]

    def _emit(self, tokens: list[int]) -> bool:
        """Emit a step's tokens, ending the generation at an end id or a limit: whether it
        goes on."""
        entries, self._entries = self._entries, []
        for i, token in enumerate(tokens):
            self._logprob = entries[i] if i < len(entries) else None
            if token in self.stops or token == NO_TOKEN:  # not part of the text
                self._finish(NO_TOKEN, "stop")
                return False
            self.generated += 1
            if self.generated >= self.params.max_tokens or self.length >= self.max_context:
                self._finish(token, "length")  # the next token would pass a limit
                return False
            self.emit(self._event(token, None))
        return True

    def _event(self, token: int, reason: str | None, code: str | None = None,
               message: str | None = None) -> list:
        """The event of a token (NO_TOKEN: none) or an end: [gen_id, token, reason] (or with
        code and message), and a token's log-probability entry when asked for."""
        if self._logprob is not None and token >= 0:
            return [self.gen_id, token, reason, code, message, self._logprob]
        return [self.gen_id, token, reason] + ([code, message] if code else [])

    def _forced_count(self) -> int:
        """How many queued forced tokens the next step feeds after its token (fast-forward):
        the count whose verify call yields the most tokens for its time (it yields them and
        the token after them), 0 when a decode step a token does better or the model verifies
        no drafts; within the largest verify entry and the limits. The ids are the same
        whatever it is."""
        spec = self.speculation
        if spec.refused:
            return 0
        return best_length(min(len(self.constraint.queued), spec.most_drafts, self._room()),
                           spec.cost or StepCost())

    def _cut(self, drafts: list[int]) -> list[int]:
        """What of `drafts` the next step may carry: under a grammar, those it allows."""
        return drafts if self.constraint is None else self.constraint.cut(drafts)

    def _room(self) -> int:
        """The most drafts the next step may carry: room for them and the token after them
        within max_tokens and the largest context."""
        return min(self.max_context - self.length, self.params.max_tokens - self.generated) - 1

    def _next_step(self, token: int) -> Request:
        """The request that feeds `token`: with prompt lookup's drafts after it when the
        generation speculates and the lookup finds some (those a grammar allows), a verify
        request."""
        drafts = []
        if self.speculator is not None:
            drafts = self.speculator.drafts(
                self._room(), None if self.constraint is None else self.constraint.cut)
        return self._step(token, drafts)

    def _step(self, token: int, drafts: list[int], forced: bool = False) -> Request:
        """The request feeding `token` and then `drafts`: speculation's, or with `forced`, the
        grammar's queued forced tokens (they stand whatever the logits say)."""
        if not drafts:
            return Request(seq_id=self.seq_id, tokens=[token], start=False, end=False,
                           reply_fn=self.on_reply)
        fed = len(drafts) if forced else 0
        accept = (greedy_acceptance if self.params.greedy else
                  functools.partial(sampled_acceptance, self.sampler))
        if self.constraint is not None:
            accept = self._grammar_acceptor(fed, accept)
        adjuster = self.sampler.adjuster
        if adjuster is not None:  # each position's logits as its own counts change them
            rule = accept
            accept = lambda rows, drafts: rule(adjuster.adjust_positions(rows, drafts), drafts)
        if self.params.logprobs is not None:  # (from the raw logits)
            accept = self._recording(accept)
        elif self.params.greedy and self.constraint is None and adjuster is None:
            accept = None  # the device's argmax decides
        return Request(seq_id=self.seq_id, tokens=[token] + drafts, start=False, end=False,
                       reply_fn=self.on_reply, draft_tokens=len(drafts), want_logits=False,
                       acceptor=accept, forced_tokens=fed)

    def _recording(self, accept):
        """`accept` that also takes the log-probability entries of the tokens a verify row
        yields (those that stood and the one after them) from their positions' raw logits."""
        def recorded(position_logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
            kept, following = accept(position_logits, drafts)
            tokens = drafts[:kept] + [following]
            self._entries = [logprob_entry(position_logits[j], t, self.params.logprobs)
                             for j, t in enumerate(tokens) if t != NO_TOKEN]
            return kept, following
        return recorded

    def _grammar_acceptor(self, fed: int, rule):
        """A verify row's acceptor under the grammar: the `fed` forced tokens stand; after
        them comes the next queued one, or the model's choice (and its drafts that stand)
        under the grammar's masks."""
        queued, constraint = list(self.constraint.queued), self.constraint

        def accept(position_logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
            if len(drafts) < fed:  # unchecked (its KV was recomputed): its token alone was fed
                return 0, queued[0]
            if len(queued) > fed:
                return fed, queued[fed]
            stood, following = constraint.accept(position_logits[fed:], drafts[fed:], rule)
            return fed + stood, following
        return accept

    def _finish(self, token: int, reason: str, code: str | None = None,
                message: str | None = None) -> None:
        self.finished = True
        if self.drafter is not None:
            self.drafter.close()
        self.emit(self._event(token, reason, code, message))
        # END frees the sequence's hold (kept for a next turn while pages allow); an END for a
        # sequence already gone (its START refused) is acknowledged.
        self.submit([end_request(self.seq_id)])


def end_request(seq_id: LocalSequenceId) -> Request:
    """The END of a local sequence, its reply ignored."""
    return Request(seq_id=seq_id, tokens=[], start=False, end=True, reply_fn=_ignore)


def _ignore(reply: Reply) -> None:
    pass


@dataclass(frozen=True)
class Speculation:
    """What the sequence model can verify: the most drafts a step can carry, or why it
    verifies none (a generation asking for speculation is then refused with that reason)."""

    most_drafts: int = 0
    refused: str | None = "the sequence model verifies no drafts"
    cost: StepCost | None = None
    vocab: int = 0  # the model's (a draft model must have the same)
    rewinds: bool = False  # whether its sequences can be cut back (it can be a draft model)
    drafters: "DraftClients | None" = None  # where draft models are reached (draft_model.py)
    # The longest prompt whose log-probabilities a generation may ask for (PromptScoring)
    most_scored: int = default_int("prompt_logprobs_max_tokens")

    def model_drafter(self, name: str, prompt: list[int], salt: str | None) -> "ModelDrafter":
        """A generation's drafter on draft model `name`, or SamplingError naming why none."""
        why = "sampling parameter speculative.method draft_model"
        if not name:
            raise SamplingError(f"{why}: the generate model names no draft model (its "
                                f"draft_model parameter: tlaloc repository --draft-model)")
        if self.drafters is None:
            raise SamplingError(f"{why}: this sequence model reaches no draft model")
        try:
            return self.drafters.drafter(name, prompt, self.vocab, salt)
        except LinkError as e:
            raise SamplingError(f"{why}: {e}") from None

    @staticmethod
    def of(engine, stats: "BatcherStats | None" = None,
           most_scored: int = default_int("prompt_logprobs_max_tokens")) -> "Speculation":
        """What `engine` can verify; `stats` (the batcher's) times its entries' recent calls,
        by which a verify call of one row is weighed against a decode call; `most_scored`:
        the model parameter prompt_logprobs_max_tokens."""
        vocab, rewinds = engine.art.model.vocab, engine.blocks.rewinds
        try:
            engine.verifier.check_speculation()
        except RequestError as e:
            return Speculation(0, str(e), vocab=vocab, rewinds=rewinds,
                               most_scored=most_scored)
        entries = engine.art.entries
        seconds = None if stats is None else (
            lambda kind, tokens: stats.call_seconds(entries, kind, 1, tokens))
        return Speculation(engine.verifier.most_drafts(), None,
                           StepCost(engine.art.verify_tokens, seconds), vocab, rewinds,
                           most_scored=most_scored)


__all__ = ["Generation", "LocalSequenceId", "NO_TOKEN", "PROMPT_LOGPROBS", "Speculation", "end_request"]

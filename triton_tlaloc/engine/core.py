"""The engine: sequences, pages, prefill and decode calls on the smallest entry that holds them,
greedy generation. `tlaloc run` uses it alone, the batcher inside the server
(docs/design.md#compiling-and-running).

State lives on the `Sequence`: its tokens, how many have KV in the pool, its pages, and (a
hybrid model, schema v4) its slot in the linear-attention state pools, held for its life.
`Engine` turns sequences into entry calls through `steps.build_step` and `Runtime.run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Container, Protocol

import numpy as np

from ..artifact.manifest import MIXED, Artifact
from ..model_parameters import default_int
from ..pages import (STATE, BlockManager, PagePool, PagesExhausted, Reuse, SharedPagePool,
                     pages_for, pool_shape, root_hash)
from ..codes import RequestError
from ..kv.sequence import Sequence, SequenceStatus
from .speculation import Verified, Verifier, accepted_drafts
from .rows import ring_room
from .steps import Row, build_mixed_step, build_step

__all__ = ["Engine", "EntryCompiling", "GenerationResult", "RequestError", "Sequence",
           "StepRuntime", "Verified", "accepted_drafts"]


class StepRuntime(Protocol):
    """What the engine needs of a runtime: the artifact, the entries it compiled, and running an
    entry on step inputs. runtime.Runtime (PJRT, the pools on the device) is one; the tests'
    FakeRuntime (checks/fakes.py) is another, which compiles nothing."""

    artifact: Artifact
    executables: Container[str]  # names of the entries that can run now
    phase_seconds: dict[str, float]  # seconds so far per phase: inputs, execute, copy

    def run(self, entry_name: str, step: dict[str, np.ndarray]) -> np.ndarray:
        """Run one entry: step inputs by role in, each row's last-token logits out."""
        ...

    def run_positions(self, entry_name: str, step: dict[str, np.ndarray],
                      logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Run a verify entry: the argmax after every position of every row [batch, tokens],
        and with `logits` the logits after every position [batch, tokens, vocab]."""
        ...

    def want(self, entry_name: str) -> None:
        """A call would rather run on this entry, not compiled yet: compile it next."""
        ...

    def compiling(self, entry_name: str) -> bool:
        """Whether this entry is still to compile in the background (False once it is
        compiled, or when its compile failed: waiting for it then raises the failure)."""
        ...

    def wait_for(self, entry_name: str) -> None:
        """Block until this entry can run (it is compiling in the background)."""
        ...


class EntryCompiling(Exception):
    """The call needs an entry still compiling, and no compiled entry stands in for it. Raised
    instead of waiting by an engine that must not block (the batcher's: it holds the call back
    and serves other sequences); nothing of the call has run, so it can be made again."""

    def __init__(self, entry_name: str):
        super().__init__(f"entry {entry_name} is compiling")
        self.entry_name = entry_name


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    prefill_ms: float
    decode_ms_per_token: list[float]
    finish_reason: str
    reused_tokens: int = 0  # prompt tokens whose KV was found cached

    @property
    def median_ms_per_token(self) -> float:
        return float(np.median(self.decode_ms_per_token)) if self.decode_ms_per_token else 0.0


class Engine:
    """Entry choice and calls over a runtime; every page is accounted for by `blocks`
    (pages.BlockManager). prefix_reuse: prompts reuse cached blocks and ended sequences are
    kept (up to `keep_ended`) for their next turn. Off unless asked for (the server asks, by
    default): a benchmark that runs a prompt twice must measure it computed twice."""

    def __init__(self, runtime: StepRuntime, prefix_reuse: bool = False,
                 keep_ended: int = default_int("keep_ended_sequences")):
        self.rt = runtime
        self.art = runtime.artifact
        self.block_size = self.art.model.block_size
        # each row's adapter slot a step input (model.lora)
        self.takes_adapters = self.art.lora is not None
        windowed = self.art.windowed
        self.ring_pages = windowed.ring_pages if windowed else 0
        self.window = windowed.window if windowed else None
        self.blocks = BlockManager(pool_shape(self.art), prefix_reuse, keep_ended)
        self.refused = {(int(t["id"]) if isinstance(t, dict) else int(t)):
                        (t.get("configKey", "refusedTokens") if isinstance(t, dict)
                         else "refusedTokens")
                        for t in self.art.model.refused_tokens}
        self._prefill = [e for e in self.art.entries.values() if e.kind == "prefill"]
        self._decode = [e for e in self.art.entries.values() if e.kind == "decode"]
        self._mixed = [e for e in self.art.entries.values() if e.kind == MIXED]
        self.max_verify_tokens = max(self.art.verify_tokens, default=0)
        # Once no decode entry is left to compile none will be again (a compile that failed
        # is not compiling): every decode row skips the search for one from then on.
        self._decode_compiles_done = False
        self.last_entry = ""  # the entry of the latest call (logs and metrics)
        self.executions = 0  # entry executions so far (a chunked prompt makes several)
        self.build_seconds = 0.0  # building step inputs, summed (the step profile)
        # A call whose entry is compiling waits for it (`tlaloc run`), or raises EntryCompiling
        # (the batcher sets this False: its thread serves other sequences meanwhile).
        self.waits_for_compiles = True
        self.verifier = Verifier(self)  # verify calls (speculative decoding)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent so far in each phase of a call: building the step inputs, and the
        runtime's (inputs to the device, the executable, the logits copy)."""
        return {"build": self.build_seconds, **self.rt.phase_seconds}

    # ------------------------------------------------------------ sequences and pages

    def new_sequence(self, prompt_ids: list[int]) -> Sequence:
        self.check_tokens(prompt_ids)
        if len(prompt_ids) == 0:
            raise RequestError("an empty prompt", "empty")
        return Sequence(list(prompt_ids))

    def check_tokens(self, ids) -> None:
        vocab = self.art.model.vocab
        for t in ids:
            if not 0 <= t < vocab:
                raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab})", "token")
            if t in self.refused:
                raise RequestError(f"token id {t} is the checkpoint's {self.refused[t]} "
                                   f"placeholder, which this text decoder refuses", "token")

    def admit(self, seq: Sequence, tokens: list[int], cache_salt: str | None = None) -> Reuse:
        """Append `tokens` to a sequence and reserve the pages they need, or raise (RequestError,
        PagesExhausted) leaving the sequence and the pools exactly as they were. A new
        sequence's prompt first takes what it finds cached (`cache_salt` is its tenant's:
        prompts of different salts share nothing); what it took is returned."""
        self.check_request(seq, tokens)
        if seq.token_ids:
            self.blocks.reserve(seq, len(seq.token_ids) + len(tokens))
            seq.token_ids += tokens
            return Reuse()
        return self._start(seq, tokens, root_hash(self.art.model.model_hash, cache_salt or "",
                                                  seq.adapter))

    def readmit(self, seq: Sequence, tokens: list[int]) -> Reuse:
        """Append `tokens` to a sequence whose KV was dropped to make room: its whole history
        and `tokens` are admitted again like a prompt of its own root (taking what prefix
        reuse still finds cached: often most of it), or raise leaving it dropped."""
        assert seq.dropped and not any(seq.holding.values()) and seq.swapped is None
        self.check_request(seq, tokens)
        history, seq.token_ids = seq.token_ids, []
        try:
            return self._start(seq, history + tokens, seq.root)
        except PagesExhausted:
            seq.token_ids = history
            raise

    def _start(self, seq: Sequence, prompt: list[int], root: bytes) -> Reuse:
        reuse = self.blocks.start(seq, prompt, root)
        try:
            self.blocks.reserve(seq, len(prompt))
        except PagesExhausted:
            self.blocks.unstart(seq, reuse)
            raise
        seq.token_ids += prompt
        if reuse.taken is not None:  # its pages are this sequence's now
            reuse.taken.move_to(SequenceStatus.FINISHED)
        return reuse

    def drop(self, seq: Sequence) -> None:
        """Give up `seq`'s KV to make room, keeping its tokens (its registered blocks stay
        cached): its next request computes them again (`readmit`)."""
        self.blocks.drop(seq)

    def check_request(self, seq: Sequence, tokens: list[int]) -> None:
        """RequestError unless `seq` can take `tokens`: known ids, within the largest context."""
        self.check_tokens(tokens)
        length = len(seq.token_ids) + len(tokens)
        if length > self.art.max_context:
            raise RequestError(f"{length} positions would exceed the largest context "
                               f"{self.art.max_context}", "context")

    def pools(self) -> dict[str, PagePool | SharedPagePool]:
        return self.blocks.pools()

    def pages_needed(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """Pages per pool `seq` must add to take `n_tokens` more tokens."""
        return self.blocks.need(seq, len(seq.token_ids) + n_tokens)

    def rollback(self, seq: Sequence, num_tokens: int, num_pages: int, num_ring: int = 0,
                 had_state_slot: bool = True) -> bool:
        """Undo an admit whose call failed (pages.BlockManager.rollback)."""
        return self.blocks.rollback(seq, num_tokens, num_pages, num_ring, had_state_slot)

    def free(self, seq: Sequence) -> None:
        self.blocks.free(seq)

    def finish(self, seq: Sequence) -> None:
        """Its client ended it: kept for the conversation's next turn, or freed."""
        self.blocks.finish(seq)

    def within_ring(self, seq: Sequence, tokens: int) -> int:
        """The most of `tokens` one prefill or mixed call may feed `seq`: with a windowed pool,
        what its ring holds past the window (a call of n tokens from p0 needs
        min(p0, window - 1) + n positions of the ring at once; docs/design.md#the-windowed-pool)."""
        return tokens if self.window is None else min(tokens, self.ring_room(seq))

    def max_call_tokens(self, seq: Sequence) -> int:
        """The most tokens one prefill call may feed `seq` now: the largest prefill entry's,
        within its ring (within_ring)."""
        return self.within_ring(seq, self.max_prefill_tokens)

    @property
    def max_prefill_tokens(self) -> int:
        """The most tokens of the prefill entries compiled so far (entries may still be
        compiling in the background); while none is, of all of them: the call then waits for
        its entry, or is held back (EntryCompiling), like any call whose entry is compiling."""
        compiled = self.rt.executables
        most = max((e.tokens_per_seq for e in self._prefill if e.name in compiled), default=0)
        return most or max((e.tokens_per_seq for e in self._prefill), default=0)

    def decode_waits_for(self, seq: Sequence) -> str | None:
        """The entry still compiling that `seq`'s decode step needs (no compiled entry stands
        in for it; it is asked for: compiled next), or None when the step can run now."""
        if self._decode_compiles_done:
            return None
        if not any(self.rt.compiling(e.name) for e in self._decode):
            self._decode_compiles_done = True
            return None
        end = len(seq.token_ids)
        if self.art.smallest_entry("decode", 1, end, among=self.rt.executables) is not None:
            return None
        best = self.art.smallest_entry("decode", 1, end)
        if best is None or not self.rt.compiling(best.name):
            return None  # the call itself says what is wrong
        self.rt.want(best.name)
        return best.name

    # ------------------------------------------------------------ calls

    def prefill(self, seqs: list[Sequence]) -> np.ndarray:
        """Feed every sequence's uncached tokens in one prefill call; returns each row's
        last-token logits [len(seqs), vocab]."""
        return self._run("prefill", seqs, [s.uncached for s in seqs])

    def decode(self, seqs: list[Sequence]) -> np.ndarray:
        """One decode step: each sequence's single uncached token."""
        for s in seqs:
            assert len(s.uncached) == 1, f"sequence {s.seq_id}: decode takes one new token"
        return self._run("decode", seqs, [s.uncached for s in seqs])

    def _run(self, kind: str, seqs: list[Sequence], feeds: list[list[int]]) -> np.ndarray:
        """One call for these rows, or while the entry for all of them is compiling, one call
        per group of as many rows as a compiled entry holds."""
        n = max(len(f) for f in feeds)
        end = max(s.num_cached + len(f) for s, f in zip(seqs, feeds))
        entry = self.entry_for(kind, len(seqs), end, n)
        if entry is not None:
            return self._call(entry, seqs, feeds)
        rows = self.compiled_rows(kind, len(seqs), end, n)
        return np.concatenate([self._run(kind, seqs[i:i + rows], feeds[i:i + rows])
                               for i in range(0, len(seqs), rows)])

    def compiled_rows(self, kind: str, batch: int, end: int, tokens: int) -> int:
        """The most rows (fewer than `batch`) a compiled entry of `kind` holds for a call."""
        return max(e.batch for e in self.art.entries.values()
                   if e.name in self.rt.executables and e.kind == kind and e.batch < batch
                   and e.context >= end and e.tokens_per_seq >= tokens)

    def prefill_chunk(self, seq: Sequence, tokens: int) -> np.ndarray:
        """A prompt's next `tokens` uncached tokens in one prefill call (the rest in later
        calls); returns the logits after the chunk's last [1, vocab]."""
        return self._run("prefill", [seq], [seq.uncached[:tokens]])

    def prefill_chunked(self, seq: Sequence) -> np.ndarray:
        """A prompt longer than the largest prefill entry's tokens goes in several calls, each
        on the smallest entry whose context holds the call's last position."""
        logits = None
        while seq.uncached:
            chunk = min(len(seq.uncached), self.max_call_tokens(seq))
            if chunk <= 0:
                raise RequestError(f"sequence {seq.seq_id}: the artifact has no prefill entry "
                                   f"that can take its prompt")
            logits = self._run("prefill", [seq], [seq.uncached[:chunk]])
        return logits

    def entry_for(self, kind: str, batch: int, end: int, tokens: int):
        """The smallest entry that holds the call. While it is compiling: a compiled larger
        one, or None when compiled entries hold fewer rows (the call is split), or it is
        waited for (EntryCompiling when the engine must not wait)."""
        if end > self.art.max_context:
            raise RequestError(f"{end} positions exceed the largest context "
                               f"{self.art.max_context}", "context")
        best = self.art.smallest_entry(kind, batch, end, tokens)
        if best is None:
            raise RequestError(f"no {kind} entry holds {batch} rows of {tokens} tokens reaching "
                               f"position {end - 1}")
        compiled = self.rt.executables
        if best.name in compiled:
            return best
        self.rt.want(best.name)
        larger = self.art.smallest_entry(kind, batch, end, tokens, among=compiled)
        if larger is not None:
            return larger
        if batch > 1 and self.art.smallest_entry(kind, 1, end, tokens, among=compiled):
            return None
        if not self.waits_for_compiles and self.rt.compiling(best.name):
            raise EntryCompiling(best.name)
        self.rt.wait_for(best.name)  # raises at once if its compile failed
        return best

    def _call(self, entry, seqs: list[Sequence], feeds: list[list[int]]) -> np.ndarray:
        step = self.step_inputs(entry, seqs, feeds)
        logits = self.rt.run(entry.name, step)[:len(seqs)]
        self._computed(seqs, feeds, logits)
        return logits

    def _computed(self, seqs: list[Sequence], feeds: list[list[int]], logits) -> None:
        """The rows' tokens have KV now. A row whose logits hold NaN or infinity may have
        written them into its KV: its blocks are not offered to other sequences (the batcher
        answers it with an error)."""
        finite = np.isfinite(logits).all(axis=-1)
        for s, feed, ok in zip(seqs, feeds, finite):
            s.num_cached += len(feed)
            if ok:
                self.blocks.register(s)
            else:
                self.blocks.withhold(s)

    # ------------------------------------------------------------ mixed calls

    @property
    def max_mixed_tokens(self) -> int:
        """The most prompt tokens a mixed call may carry (0: the artifact has no mixed
        entry)."""
        return max((e.tokens_per_seq for e in self._mixed), default=0)

    @property
    def mixed_chunk_sizes(self) -> list[int]:
        """The chunks the mixed entries take, in tokens, ascending (none: no mixed entry)."""
        return sorted({e.tokens_per_seq for e in self._mixed})

    def mixed_entry(self, rows: int, end: int, tokens: int):
        """The smallest compiled mixed entry that holds `rows` decode rows and a chunk of
        `tokens` tokens, every row reaching position `end` - 1, or None (the calls then run
        apart). A better one still compiling is asked for."""
        best = self.art.smallest_entry(MIXED, rows, end, tokens)
        if best is None or best.name in self.rt.executables:
            return best
        self.rt.want(best.name)
        return self.art.smallest_entry(MIXED, rows, end, tokens, among=self.rt.executables)

    def mixed(self, seqs: list[Sequence], chunk: Sequence, tokens: int):
        """One mixed call: each of `seqs` its one uncached token, and `chunk` (a prompt) its
        next `tokens` uncached ones, in one execution (docs/design.md#mixed-steps). Returns the
        logits of each of `seqs` and of the chunk's last token [len(seqs) + 1, vocab], or None
        when no compiled mixed entry holds the call (nothing ran)."""
        for s in seqs:
            assert len(s.uncached) == 1, f"sequence {s.seq_id}: decode takes one new token"
        feed = chunk.uncached[:tokens]
        assert feed, f"sequence {chunk.seq_id}: no prompt token to compute"
        assert self.within_ring(chunk, len(feed)) == len(feed), \
            f"sequence {chunk.seq_id}: {len(feed)} tokens overrun its ring"
        end = max(max(s.num_cached + 1 for s in seqs), chunk.num_cached + len(feed))
        entry = self.mixed_entry(len(seqs), end, len(feed))
        if entry is None:
            return None
        feeds = [s.uncached for s in seqs]
        rows = self._rows([*seqs, chunk], [*feeds, feed])
        self._count_call(entry)
        t0 = time.perf_counter()
        step = build_mixed_step(entry, rows[:-1], rows[-1], self.block_size,
                                self.takes_adapters, self.ring_pages, STATE in self.blocks.kinds)
        self.build_seconds += time.perf_counter() - t0
        out = self.rt.run(entry.name, step)
        logits = np.concatenate([out[:len(seqs)], out[entry.batch:entry.batch + 1]])
        self._computed([*seqs, chunk], [*feeds, feed], logits)
        return logits

    def step_inputs(self, entry, seqs: list[Sequence], feeds: list[list[int]]) -> dict:
        """The step inputs of one call, after checking each row's pages."""
        rows = self._rows(seqs, feeds)
        self._count_call(entry)
        t0 = time.perf_counter()
        step = build_step(entry, rows, self.block_size, self.ring_pages,
                          STATE in self.blocks.kinds, self.takes_adapters)
        self.build_seconds += time.perf_counter() - t0
        return step

    def _count_call(self, entry) -> None:
        self.last_entry = entry.name
        self.executions += 1

    def _rows(self, seqs: list[Sequence], feeds: list[list[int]]) -> list[Row]:
        """Each sequence's row of a call feeding it `feed`, after checking its pages."""
        for s, feed in zip(seqs, feeds):
            if s.num_cached + len(feed) > self.art.max_context:
                raise RequestError(f"sequence {s.seq_id}: {s.num_cached + len(feed)} positions "
                                   f"exceed the largest context {self.art.max_context}",
                                   "context")
            self.blocks.reserve(s, s.num_cached + len(feed))
            self.blocks.check_writes(s)
        # A row's block table names the pages up to its call's end: a sequence may hold more
        # (admitted for a whole prompt that runs in chunks) than a small entry's table holds.
        rows = []
        for s, feed in zip(seqs, feeds):
            blocks = pages_for(s.num_cached + len(feed), self.block_size)
            rows.append(Row(tuple(feed), s.num_cached, tuple(s.pages[:blocks]),
                            tuple(s.ring[:min(blocks, self.ring_pages)]),
                            -1 if s.state_slot is None else s.state_slot, s.adapter_slot))
        return rows

    # ------------------------------------------------------------ generation

    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                        stop_ids: tuple[int, ...] = (), cache_salt: str | None = None,
                        speculate: int = 0, drafter=None,
                        adapter: tuple[int, str] = (0, "")) -> GenerationResult:
        """Greedy ids for a prompt. The prompt reuses what earlier ones left cached (when the
        engine reuses prefixes) and the sequence is kept for a next turn afterwards. With
        `speculate`, each step after the prompt also verifies up to that many drafts from
        `drafter(history, k)`: the same ids, in fewer calls when drafts are accepted.
        `adapter`: the LoRA adapter's slot in the runtime's adapter pools and its identity
        (model.lora; (0, "") none)."""
        if len(prompt_ids) == 0:
            raise RequestError("an empty prompt", "empty")
        seq = Sequence([])
        seq.adapter_slot, seq.adapter = adapter
        t0 = time.perf_counter()
        reuse = self.admit(seq, list(prompt_ids), cache_salt)
        try:
            if speculate:
                self.verifier.check_speculation()
            logits = self.prefill_chunked(seq)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            generated, step_ms, reason = [], [], None
            new = [int(np.argmax(logits[0]))]
            while True:
                for token in new:
                    generated.append(token)
                    if token in stop_ids:
                        reason = "stop"
                        break
                    if len(generated) >= max_new_tokens:
                        reason = "length"
                        break
                if reason is not None:
                    break
                if len(seq.token_ids) + 1 > self.art.max_context:
                    reason = "context"
                    break
                t0 = time.perf_counter()
                k = min(speculate, max_new_tokens - len(generated) - 1,
                        self.verifier.verify_room(seq))
                drafts = drafter(list(prompt_ids) + generated, k) if k > 0 else []
                new = self.verifier.greedy_step(seq, generated[-1], drafts)
                step_ms.append((time.perf_counter() - t0) * 1e3)
        except BaseException:
            self.free(seq)
            raise
        self.finish(seq)
        return GenerationResult(list(prompt_ids), generated, prefill_ms, step_ms, reason,
                                reused_tokens=reuse.reused)

    @property
    def ring_positions(self) -> int:
        """The positions a sequence's ring holds."""
        return self.ring_pages * self.block_size

    def ring_room(self, seq: Sequence | None) -> int:
        """The tokens one call may feed `seq` within its ring (None: any sequence whose window
        is full; rows.ring_room)."""
        return ring_room(self.ring_positions, self.window, None if seq is None else seq.num_cached)

"""vLLM's scheduled rows run on an artifact's entries (no vLLM imported here: the worker turns
its SchedulerOutput into these calls, and the tests drive this over a fake runtime).

vLLM's scheduler decides everything a step holds: which requests run, how many of their
tokens, and in which pages (its block ids are the artifact's page numbers: the same block size,
and both keep page 0 back). The runner keeps each request's tokens, pages and computed count
(vLLM sends its sampled tokens back only to a pipeline), and runs the step as the engine would:
the step's prompts together on the smallest prefill entry that holds them, in groups of the
largest prefill batch and pieces of at most the largest prefill entry's tokens; one-token rows
(decode steps, and a prompt's last token after a prefix-cache hit) together on the smallest
decode entry, in groups of the largest decode batch.
A request whose whole history is computed gets its last logits (the worker samples them with
vLLM's Sampler, `step` takes their argmax); a prompt chunk gets nothing. A request that asks for
its prompt's logprobs runs its prompt chunks alone on verify entries, which give the logits
after every position (`chunk_logits`), not only after the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.steps import Row, build_step
from ..pages import pages_for


@dataclass
class RequestState:
    tokens: list[int]  # the prompt and the tokens generated so far
    pages: list[int]  # vLLM's block ids for it, in order: the artifact's pages
    computed: int  # tokens whose KV the pages hold (vLLM's num_computed_tokens)
    prompt_len: int = 0  # tokens[:prompt_len] are the prompt, the rest generated
    every_position: bool = False  # its chunks' logits after every position are kept

    @property
    def prompt(self) -> list[int]:
        return self.tokens[:self.prompt_len]

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class ArtifactRunner:
    """Requests by vLLM's id, and `step`: one scheduler step's rows as entry calls."""

    def __init__(self, runtime):
        self.rt = runtime
        self.art = runtime.artifact
        self.block_size = self.art.model.block_size
        self.requests: dict[str, RequestState] = {}
        self.max_prefill = max(e.tokens_per_seq for e in self.art.entries.values()
                               if e.kind == "prefill")
        self.max_decode_batch = max(e.batch for e in self.art.entries.values()
                                    if e.kind == "decode")
        self.max_prefill_batch = max(e.batch for e in self.art.entries.values()
                                     if e.kind == "prefill")
        self.adapters = self.art.lora is not None  # (rows run on slot 0: no adapter)
        self.max_verify = max(self.art.verify_tokens, default=0)
        self.chunk_logits: dict[str, np.ndarray] = {}  # this step's, of every_position rows
        self.calls = 0

    # ---------------------------------------------------------------- vLLM's requests

    def add(self, req_id: str, tokens: list[int], pages: list[int], computed: int,
            every_position: bool = False) -> None:
        """A request scheduled for the first time (`computed`: its prefix-cache hit;
        `every_position`: its prompt's logprobs are asked for)."""
        assert not every_position or self.max_verify, "every position needs verify entries"
        self.requests[req_id] = RequestState(list(tokens), list(pages), computed, len(tokens),
                                             every_position)

    def update(self, req_id: str, computed: int, new_pages: list[int] | None = None,
               resumed: bool = False, tokens: list[int] | None = None) -> None:
        """A running request's next step: pages added, or (resumed after a preemption) its pages
        replaced and, when vLLM sends them, its tokens."""
        st = self.requests[req_id]
        if resumed:
            st.pages = list(new_pages or [])
            if tokens is not None:
                st.tokens = list(tokens)
        elif new_pages:
            st.pages.extend(new_pages)
        st.computed = computed

    def finish(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ---------------------------------------------------------------- a step

    def step(self, scheduled: dict[str, int]) -> list[list[int]]:
        """Run `scheduled` (request id: tokens to compute) and decode greedily: each request's
        new token, or none for a prompt chunk, in the same order."""
        logits = self.run(scheduled)
        sampled = []
        for rid in scheduled:
            if rid not in logits:
                sampled.append([])  # a prompt chunk
                continue
            token = int(np.argmax(logits[rid]))
            self.append(rid, token)
            sampled.append([token])
        return sampled

    def append(self, req_id: str, token: int) -> None:
        """The token drawn from the request's last logits."""
        self.requests[req_id].tokens.append(token)

    def run(self, scheduled: dict[str, int]) -> dict[str, np.ndarray]:
        """Run `scheduled` (request id: tokens to compute): the last logits of each request
        whose whole history is now computed (prompt chunks have none). The logits after each
        position the step computed of an `every_position` request: `chunk_logits`."""
        self.chunk_logits = {}
        single = [rid for rid, n in scheduled.items() if n == 1]
        every = {rid: n for rid, n in scheduled.items()
                 if n > 1 and self.requests[rid].every_position}
        logits = self._prefill({rid: n for rid, n in scheduled.items()
                                if n > 1 and rid not in every})
        for rid, n in every.items():
            self.chunk_logits[rid] = self._every_position(self.requests[rid], n)
            logits[rid] = self.chunk_logits[rid][-1]
        for i in range(0, len(single), self.max_decode_batch):
            group = single[i:i + self.max_decode_batch]
            states = [self.requests[rid] for rid in group]
            out = self._call("decode", [(st, 1) for st in states])
            for rid, st, row in zip(group, states, out):
                st.computed += 1
                logits[rid] = row
                if st.every_position:
                    self.chunk_logits[rid] = row[None]
        for rid in scheduled:
            st = self.requests[rid]
            assert st.computed <= len(st.tokens), (rid, st.computed, len(st.tokens))
            if st.computed < len(st.tokens):
                del logits[rid]  # a prompt chunk: nothing to sample yet
        return logits

    def _prefill(self, tokens: dict[str, int]) -> dict[str, np.ndarray]:
        """Each request's `tokens[rid]` tokens, the requests together in calls of the largest
        prefill batch, each call feeding a row at most the largest prefill entry's tokens;
        each request's logits after its last piece."""
        left, logits = dict(tokens), {}
        while left:
            group = list(left)[:self.max_prefill_batch]
            rows = [(self.requests[rid], min(left[rid], self.max_prefill)) for rid in group]
            for rid, (st, k), row in zip(group, rows, self._call("prefill", rows)):
                st.computed += k
                left[rid] -= k
                logits[rid] = row
                if not left[rid]:
                    del left[rid]
        return logits

    def _every_position(self, st: RequestState, n: int) -> np.ndarray:
        """`st`'s next n tokens alone, in verify calls of at most the largest verify entry's
        tokens: the logits after each of them [n, vocab]."""
        out = []
        while n:
            k = min(n, self.max_verify)
            out.append(self._call("verify", [(st, k)])[0, -k:])  # (rows are right-aligned)
            st.computed += k
            n -= k
        return np.concatenate(out)

    def _call(self, kind: str, rows: list[tuple[RequestState, int]]) -> np.ndarray:
        """One call of `kind` feeding each row k tokens from its computed count (a verify
        call: the logits after every position of the call)."""
        end = max(st.computed + k for st, k in rows)
        tokens = max(k for _, k in rows)
        entry = self.art.smallest_entry(kind, len(rows), end, tokens)
        if entry is None:
            raise ValueError(f"no {kind} entry holds {len(rows)} rows of {tokens} tokens "
                             f"reaching position {end - 1}")
        step_rows = []
        for st, k in rows:
            last = st.computed + k
            assert len(st.pages) * self.block_size >= last, \
                f"{len(st.pages)} pages do not hold {last} positions"
            step_rows.append(Row(tuple(st.tokens[st.computed:last]), st.computed,
                                 tuple(st.pages[:pages_for(last, self.block_size)])))
        step = build_step(entry, step_rows, self.block_size, adapters=self.adapters)
        self.rt.wait_for(entry.name)  # (compiling in the background: waited for)
        self.calls += 1
        if kind == "verify":
            return self.rt.run_positions(entry.name, step, True)[1][:len(rows)]
        return self.rt.run(entry.name, step)[:len(rows)]


def mask_rows(logits: np.ndarray, rows: list[str], masked: list[str],
              bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of every token a request's grammar does not allow
    now: `bitmask` has a row for each of `masked` (vLLM's structured-output requests of the
    step, in its order), bit j of its word k allowing token 32k + j (xgrammar's layout)."""
    where = {rid: i for i, rid in enumerate(rows)}
    vocab = logits.shape[1]
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool)
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary: never allowed
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    for k, rid in enumerate(masked):
        assert rid in where, f"{rid}: a grammar row for a request that samples nothing now"
        logits[where[rid], ~allowed[k, :vocab]] = -np.inf

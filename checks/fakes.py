"""Test doubles for the pure-Python parts: a clock the test moves, an artifact described in code
(no export, no files), a runtime that compiles nothing (engine.StepRuntime), and a harness that
drives a batcher over them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from triton_tlaloc.batcher import Batcher, Reply, Request
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.kv.host_tier import HostPages, HostTier
from triton_tlaloc.generation.local_generation import Generation
from triton_tlaloc.kv.page_pools import FULL, STATE, WINDOWED
from triton_tlaloc.artifact.manifest import (CHUNK, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, STEP_ROLES,
                                             TOKEN_IDS, Artifact, Entry, KvPool, LinearState,
                                             ModelShape, Program, WindowedKv)
from triton_tlaloc.scheduling.policy import BatchPolicy
from triton_tlaloc.runtime.simulated import one_hot


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _entry(kind: str, batch: int, context: int, tokens: int, suffix: str = "") -> Entry:
    name = f"{kind}_b{batch}_c{context}{suffix}"
    return Entry(name, kind, batch, context, tokens, body="", sha256="", program_path="",
                 program=Program(name, (), (), ()))


def fake_artifact(batch_ladder=(1, 2), context_ladder=(32, 128), block_size=8, vocab=256,
                  num_blocks=None, prefill_tokens=(32, 64), window=None, ring_pages=0,
                  window_blocks=0, state_slots=0, refused_tokens=(),
                  verify_tokens=(3, 5, 9), prefill_chunk=None, adapter_slots=0,
                  mixed_tokens=()) -> Artifact:
    """The entries and pools an export of these ladders has (the tests' tiny llama by default:
    batches 1 and 2, contexts 32 and 128, pages of 8 tokens, 33 pages of which 32 usable), with
    no body, program or weight behind them. `window` adds a windowed pool of rings (schema v3),
    `state_slots` linear-attention state slots (schema v4). `prefill_chunk`: the most tokens a
    prefill entry takes (an export's --prefill-chunk; None: the whole context).
    `adapter_slots`: LoRA adapter pools of that many slots besides slot 0 (model.lora).
    `mixed_tokens`: mixed entries' chunks (an export's --mixed-tokens)."""
    if num_blocks is None:
        num_blocks = max(batch_ladder) * max(context_ladder) // block_size + 1
    entries = {}
    for c in sorted(context_ladder):
        for b in sorted(batch_ladder):
            most = min(c, prefill_chunk or c)
            for e in [_entry("decode", b, c, 1)] + [
                    _entry("prefill", b, c, t, f"_t{t}") for t in prefill_tokens if t < most] + [
                    _entry("prefill", b, c, most)] + [
                    _entry("verify", b, c, t, f"_t{t}") for t in verify_tokens
                    if t <= c and not state_slots] + [
                    _entry("mixed", b, c, t, f"_t{t}") for t in mixed_tokens if t <= c]:
                entries[e.name] = e
    model = ModelShape(family="llama", model_name="fake", model_hash="", layers=1, heads=1,
                       kv_heads=1, head_size=4, hidden_size=4, intermediate_size=4, vocab=vocab,
                       block_size=block_size, num_blocks=num_blocks, weight_dtype="f32",
                       kv_dtype="f32", max_positions=max(context_ladder),
                       refused_tokens=tuple(refused_tokens))
    shape = (num_blocks, block_size, 1, 4)
    pools = (KvPool("k0", 0, "k", "f32", shape), KvPool("v0", 0, "v", "f32", shape))
    windowed = linear = None
    schema = SCHEMA_V2
    if window is not None:
        schema = SCHEMA_V3
        windowed = WindowedKv(window, (0,), ring_pages, window_blocks)
        pools = tuple(KvPool(p.name, 0, p.kind, "f32", (window_blocks, block_size, 1, 4),
                             "windowed") for p in pools)
    if state_slots:
        schema = SCHEMA_V4
        linear = LinearState((0,), state_slots, 4, 1, 1, 4, 4, ())
    manifest = {}
    if adapter_slots:
        from triton_tlaloc.lora.layout import lora_layout
        manifest = {"model": {"lora": lora_layout(4, adapter_slots + 1, 1, 4, 4, 4, 4, 4)
                              .to_json()}}
    return Artifact(Path("fake-artifact"), schema, model, tuple(batch_ladder),
                    tuple(context_ladder), entries, (), pools, manifest=manifest,
                    windowed=windowed, linear_state=linear)


# What the fake's full-history KV holds at a slot a faulty row wrote: NaN (see FakeRuntime).
NAN_KV = -2


class FakeRuntime:
    """Runs no program: each row's logits are one-hot at (last token + last position) % vocab,
    so a reply shows which row it came from. Records every call as (entry, live rows). Its
    "KV" is the token written at each slot (`kv`, per pool class; a state slot holds a hash of
    every token fed to it), so a test can read back what a sequence's pages hold.

    NaN, as attention spreads it: a token in `nan_once` makes the next row that feeds it write
    NaN KV (NAN_KV at every full-history slot the row writes; a fault, once, so the same tokens
    computed again are finite), and a row whose logits read a NAN_KV slot (a position below
    its length in its block table) gets NaN logits. The host tier's transfers carry NAN_KV like
    any token."""

    def __init__(self, artifact: Artifact, compiling=()):
        self.artifact = artifact
        # `compiling`: entries not compiled yet; one is compiled when waited for, or by
        # `finish_compile` (`fail_compile`: its compile failed)
        self.executables = {name: None for name in artifact.entries if name not in compiling}
        self.failed: set[str] = set()
        self.wanted: list[str] = []
        self.waited: list[str] = []
        self.calls: list[tuple[str, int]] = []
        self.mixed_calls: list[tuple[str, int]] = []  # a mixed call: (entry, decode rows)
        self.adapter_slots: list[list[int]] = []  # each call's rows' LORA_SLOTS (model.lora)
        self.phase_seconds = {"inputs": 0.0, "execute": 0.0, "copy": 0.0}
        self.fail_next = None  # an exception the next run raises
        self.nan_once: set[int] = set()  # tokens whose next row writes NaN KV
        self.nan_rows: list[int] = []  # the last call's rows whose logits are NaN
        bs = artifact.model.block_size
        self.kv = {FULL: np.full((artifact.model.num_blocks, bs), -1, np.int64)}
        if artifact.windowed is not None:
            self.kv[WINDOWED] = np.full((artifact.windowed.num_blocks, bs), -1, np.int64)
        if artifact.linear_state is not None:
            self.kv[STATE] = np.zeros((artifact.linear_state.num_slots, 1), np.int64)

    def want(self, entry_name: str) -> None:
        self.wanted.append(entry_name)

    def compiling(self, entry_name: str) -> bool:
        return entry_name not in self.executables and entry_name not in self.failed

    def wait_for(self, entry_name: str) -> None:
        self.waited.append(entry_name)
        if entry_name in self.failed:
            raise RuntimeError(f"entry {entry_name} failed to compile: out of memory")
        self.executables[entry_name] = None

    def finish_compile(self, entry_name: str) -> None:
        assert self.compiling(entry_name)
        self.executables[entry_name] = None

    def kv_of(self, seq) -> list[int]:
        """The tokens a sequence's full-history pages hold at its computed positions."""
        return self.kv[FULL][seq.pages].ravel()[:seq.num_cached].tolist()

    def _write_kv(self, step: dict) -> None:
        tokens, positions = step["TOKEN_IDS"], step["POSITIONS"]
        for pool_class, key in ((FULL, "SLOT_MAPPING"), (WINDOWED, "WINDOW_SLOT_MAPPING")):
            if key in step and pool_class in self.kv:
                slots = step[key]
                flat = self.kv[pool_class].reshape(-1)
                flat[slots[slots >= 0]] = tokens[slots >= 0]
        if "STATE_SLOTS" in step:
            for r, slot in enumerate(step["STATE_SLOTS"]):
                if slot < 0:
                    continue
                for t, pos in zip(tokens[r], positions[r]):
                    h = 0 if pos == 0 else int(self.kv[STATE][slot, 0])
                    self.kv[STATE][slot, 0] = (h * 31 + int(t) + 1) % (1 << 40)

    def _write_nan(self, step: dict) -> None:
        """The rows feeding a token of `nan_once` write NaN KV (that token is then spent); the
        rows that read NaN KV are `nan_rows`."""
        self.nan_rows = []
        if "SLOT_MAPPING" not in step:
            return
        tokens, slots = step["TOKEN_IDS"], step["SLOT_MAPPING"]
        flat = self.kv[FULL].reshape(-1)
        faulty = [r for r, row in enumerate(tokens) if self.nan_once
                  and any(int(t) in self.nan_once for t, s in zip(row, slots[r]) if s >= 0)]
        for r in faulty:
            flat[slots[r][slots[r] >= 0]] = NAN_KV
            self.nan_once -= {int(t) for t in tokens[r]}
        if not (flat == NAN_KV).any():
            return
        bs = self.artifact.model.block_size
        for r, (table, length) in enumerate(zip(step["BLOCK_TABLES"], step["SEQ_LENS"])):
            read = [int(table[p // bs]) * bs + p % bs for p in range(int(length))]
            if (flat[read] == NAN_KV).any():
                self.nan_rows.append(r)

    def run(self, entry_name: str, step: dict[str, np.ndarray]) -> np.ndarray:
        if CHUNK + TOKEN_IDS in step:  # a mixed call: [batch] decode rows, then the chunk's row
            chunk = {role: step.pop(CHUNK + role) for role in STEP_ROLES}
            rows = self.run(entry_name, step)
            nan_rows = self.nan_rows
            _, decode_rows = self.calls.pop()
            last = self.run(entry_name, chunk)
            self.calls[-1] = (entry_name, decode_rows + 1)
            self.mixed_calls.append((entry_name, decode_rows))
            self.nan_rows = nan_rows + [len(rows)] * bool(self.nan_rows)
            return np.concatenate([rows, last])
        argmax = self._execute(entry_name, step)
        out = one_hot(argmax[:, -1], self.artifact.model.vocab)
        out[self.nan_rows] = np.nan
        return out

    def run_positions(self, entry_name: str, step: dict[str, np.ndarray],
                      logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """A verify entry: the same rule after every position."""
        argmax = self._execute(entry_name, step)
        out = one_hot(argmax, self.artifact.model.vocab) if logits else None
        if out is not None:
            out[self.nan_rows] = np.nan
        return argmax, out

    def _execute(self, entry_name: str, step: dict[str, np.ndarray]) -> np.ndarray:
        """One call: recorded, its KV written; the rule's next token after every position."""
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        tokens, positions, lens = step["TOKEN_IDS"], step["POSITIONS"], step["SEQ_LENS"]
        self.calls.append((entry_name, int((lens > 0).sum())))
        if "LORA_SLOTS" in step:
            self.adapter_slots.append(step["LORA_SLOTS"][:int((lens > 0).sum())].tolist())
        self._write_kv(step)
        self._write_nan(step)
        return ((tokens + positions) % self.artifact.model.vocab).astype(np.int32)


class FakeTransfer:
    """kv_transfer.PageTransfer over a FakeRuntime's `kv`: rows copied out and back."""

    def __init__(self, runtime: FakeRuntime):
        self.rt = runtime
        self.reads = self.writes = 0

    def page_bytes(self, pool_class: str) -> int:
        kv = self.rt.kv.get(pool_class)
        return 0 if kv is None else kv[0].nbytes

    def read(self, pool_class: str, pages: list[int]) -> HostPages:
        self.reads += 1
        return HostPages(pool_class, {"kv": self.rt.kv[pool_class][pages].copy()})

    def write(self, host: HostPages, pages: list[int]) -> None:
        assert len(pages) == host.count
        self.writes += 1
        self.rt.kv[host.pool_class][pages] = host.arrays["kv"]


class Harness:
    """A batcher over a FakeRuntime and a Clock, driven round by round on the test's thread; each
    sequence's replies are kept in order."""

    def __init__(self, artifact, prefix_reuse=True, host_bytes=0, preempt_wait_s=10.0,
                 compiling=(), adapters=None, **policy):
        self.clock = Clock()
        self.rt = FakeRuntime(artifact, compiling)
        # KV reuse on, as the server runs it by default
        engine = Engine(self.rt, prefix_reuse=prefix_reuse)
        self.transfer = FakeTransfer(self.rt)
        host = HostTier(engine.blocks, self.transfer, host_bytes) if host_bytes else None
        self.batcher = Batcher(engine, BatchPolicy(**policy), clock=self.clock, host_tier=host,
                               preempt_wait_s=preempt_wait_s, adapters=adapters)
        self.replies: dict = {}

    def send(self, seq_id, tokens, start=False, end=False, refusal=None, draft_tokens=0,
             **request):
        def reply_fn(reply: Reply):
            self.replies.setdefault(seq_id, []).append(reply)
        self.batcher.submit(Request(seq_id, list(tokens), start, end, reply_fn,
                                    refusal=refusal, draft_tokens=draft_tokens, **request))

    def run(self) -> list[tuple[str, int]]:
        """Rounds due now; returns the calls they made."""
        before = len(self.rt.calls)
        while self.batcher.run_pending():
            pass
        return self.rt.calls[before:]

    def compile(self, entry_name: str) -> None:
        """The entry finishes compiling in the background."""
        self.rt.finish_compile(entry_name)
        self.batcher.entries_compiled()

    def last(self, seq_id) -> Reply:
        return self.replies[seq_id][-1]

    def drive(self, plans: dict, rounds: int = 400, each_round=None, starts=None) -> dict:
        """Clients that wait for their replies: each sequence of `plans` ({id: (prompt, new)})
        STARTs with its prompt (in round `starts[id]`, default the first), then decode steps
        fed its own argmax, `new` tokens in all, the last request with END; a request is sent
        only once the previous one is answered. `each_round(self)` after every round (a test's
        invariants). Returns each sequence's generated ids; AssertionError when a reply is an
        error or they do not finish."""
        out = {k: [] for k in plans}
        sent = {k: 0 for k in plans}
        starts = starts or {}
        for n in range(rounds):
            for k, (prompt, new) in plans.items():
                replies = self.replies.get(k, [])
                if sent[k] != len(replies) or len(out[k]) >= new or n < starts.get(k, 0):
                    continue
                if sent[k] == 0:
                    self.send(k, prompt, start=True)
                else:
                    assert replies[-1].error is None, replies[-1].error
                    out[k].append(int(np.argmax(replies[-1].logits)))
                    if len(out[k]) >= new:
                        continue
                    self.send(k, [out[k][-1]], end=len(out[k]) == new - 1)
                sent[k] += 1
            self.clock.advance(0.05)
            self.run()
            if each_round is not None:
                each_round(self)
            if all(len(out[k]) >= new for k, (_, new) in plans.items()):
                return out
        raise AssertionError(f"not finished: {out}")

    def step(self, seq_id, tokens, start=False, end=False, refusal=None,
             draft_tokens=0, **request) -> Reply:
        """Send one request, move the clock past every wait, run what is due, return the
        request's reply (each request in a round of its own)."""
        self.send(seq_id, tokens, start, end, refusal, draft_tokens, **request)
        self.clock.advance(1.0)
        self.run()
        return self.last(seq_id)


class KnownModel:
    """A model whose greedy continuation of the prompt is `text`, answering a generation's
    requests as the batcher would (decode: logits; verify: the drafts that match, then the
    next token), and counting its calls."""

    def __init__(self, prompt: list[int], text: list[int], vocab: int = 64):
        self.all, self.vocab = prompt + text, vocab
        self.fed = 0  # tokens the sequence holds
        self.calls = self.verify_calls = 0
        self.drafted = self.accepted = 0

    def answer(self, request) -> Reply:
        self.calls += 1
        self.fed += len(request.tokens)
        if not request.draft_tokens:
            return Reply(logits=one_hot(np.array(self.all[self.fed]), self.vocab))
        self.verify_calls += 1
        d = request.draft_tokens
        drafts, at = request.tokens[-d:], self.fed - d
        m = 0
        while m < d and drafts[m] == self.all[at + m]:
            m += 1
        self.fed = at + m
        self.drafted += d
        self.accepted += m
        return Reply(accepted_ids=drafts[:m] + [self.all[self.fed]])


def run_generation(model: KnownModel, prompt: list[int], params, speculation,
                   draft_model: str = ""):
    """A local generation answered by `model` until its END, its next steps (queued, or
    submitted at once when a draft model's drafts arrive) run in order: (ids emitted, finish
    reason, the generation)."""
    events, queued = [], []
    gen = Generation(1, prompt, params, set(), 4096, events.append, queued.extend, speculation,
                     draft_model, queued.extend)
    queued.append(gen.start_request())
    while queued and not queued[0].end:
        gen.on_reply(model.answer(queued.pop(0)))
    return [e[1] for e in events if e[1] >= 0], events[-1][2], gen

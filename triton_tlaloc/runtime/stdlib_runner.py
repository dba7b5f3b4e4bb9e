"""Greedy generation from an artifact with a PJRT plugin and Python's standard library alone: no
JAX, no numpy, no torch (`tlaloc run --runtime capi --stdlib`). The artifact is the whole
deployment: its manifest, weight files and program texts, a plugin's shared library, and this.

It is the engine's path for one sequence, written over bytes and `array`s: the weights read
from their files as bytes (a split weight's device parts cut from them: sharding.shard_bytes),
the pools zeroed on the device and donated to every call (their addresses checked each call),
the pages reserved by the engine's block manager (pages.py, pure Python), each call's step
inputs from the engine's rows (engine/rows.py), the prompt in chunks on the smallest prefill
entry that holds each, then one decode call a token, and the argmax read from the logits'
bytes. Windowed rings (schema v3), linear-attention state slots (v4) and tensor-parallel
artifacts (the plugin's devices) run; LoRA adapter pools do not (the engine's runtime serves
them).
"""

from __future__ import annotations

import math
import statistics
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact.loading import load_artifact
from ..artifact.manifest import (BLOCK_TABLES, LOGITS, LORA_POOL, POOL_IN_ROLES, POOL_OUT_ROLES,
                                 POSITIONS, SEQ_LENS, SLOT_MAPPING, STATE_SLOTS, TOKEN_IDS, WEIGHT,
                                 WINDOW_BLOCK_TABLES, WINDOW_SLOT_MAPPING, ArtifactError,
                                 element_bytes, tensor_bytes)
from ..artifact.stablehlo import strip_aliasing
from ..kv.sequence import Sequence
from ..pages import BlockManager, pages_for, pool_shape
from ..engine.rows import Row, RowInputs, padding_inputs, ring_room, row_inputs
from .capi import element_name
from .compile_cache import CompileStats, compile_cached, default_cache_dir
from .pjrt import open_devices

# What each step input holds of a row's values (the rest: STATE_SLOTS, the row's state slot)
ROW_VALUES = {TOKEN_IDS: "token_ids", POSITIONS: "positions", SLOT_MAPPING: "slot_mapping",
              BLOCK_TABLES: "block_table", WINDOW_BLOCK_TABLES: "window_table",
              WINDOW_SLOT_MAPPING: "window_slots"}


@dataclass
class StdlibResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    prefill_ms: float
    decode_ms_per_token: list[float]
    finish_reason: str
    first_logits: array = field(repr=False, default=None)  # after the prompt (f32)

    @property
    def median_ms_per_token(self) -> float:
        return statistics.median(self.decode_ms_per_token) if self.decode_ms_per_token else 0.0


class StdlibRunner:
    """An artifact's weights and pools on a plugin's devices, its entries compiled the first
    time a call needs them, and `generate_greedy` for one sequence."""

    def __init__(self, artifact: str | Path, plugin: str | None = None, donate: bool = True,
                 cache_dir: Path | None = None):
        self.art = load_artifact(artifact)
        if self.art.lora is not None:
            raise ArtifactError(f"{self.art.path}: LoRA adapter pools are not run with the "
                                f"standard library alone (run it without --stdlib)")
        self.device = open_devices(self.art, "cpu", 0, None, plugin or "")
        self.size = self.device.size
        self.donate = donate
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.compile_stats = CompileStats()
        self.executables: dict[str, object] = {}
        self.weights = self._upload_weights()
        self.pools = self._zeroed_pools()
        self.blocks = BlockManager(pool_shape(self.art), prefix_reuse=False, keep_ended=0)
        windowed = self.art.windowed
        self.ring_pages = windowed.ring_pages if windowed else 0
        self.window = windowed.window if windowed else None
        self.calls = self.in_place = self.copied = 0

    # ---------------------------------------------------------------- values on the devices

    def _put(self, parts: list, element: str, shape) -> object:
        """A value from host bytes: parts[j] on device j (one part: the same on every device)."""
        devices = self.device.devices
        if len(parts) == 1:
            parts = parts * len(devices)
        buffers = tuple(self.device.put_bytes(p, element, shape, d)
                        for p, d in zip(parts, devices))
        return buffers[0] if self.size == 1 else buffers

    def _upload_weights(self) -> dict[str, object]:
        tp, n = self.art.tensor_parallel, self.size
        as_taken = self.art.weight_input_dtypes()  # a bf16 file as its bits where so taken
        out = {}
        for w in self.art.weights:
            data, element = _read(self.art.path / w.file), as_taken[w.slot]
            split = tp.weights.get(w.slot) if tp is not None else None
            if split is None:
                out[w.slot] = self._put([data], element, w.shape)
            else:
                size = element_bytes(element)
                out[w.slot] = self._put([split.shard_bytes(data, w.shape, size, j, n)
                                         for j in range(n)], element,
                                        split.shard_shape(w.shape, n))
        return out

    def _zeroed_pools(self) -> dict[str, object]:
        tp, held = self.art.tensor_parallel, self.art.pool_input_dtypes()
        out = {}
        for p in (*self.art.pools, *self.art.state_pools):
            shape = p.shape if tp is None else tp.pools[p.name].shard_shape(p.shape, tp.devices)
            out[p.name] = self._put([bytearray(tensor_bytes(held[p.name], shape))],
                                    held[p.name], shape)
        return out

    def _executable(self, name: str):
        if name not in self.executables:
            text = self.art.body_text(self.art.entries[name])
            if not self.donate:
                text = strip_aliasing(text)  # the control: pools copied every call
            self.executables[name] = compile_cached(self.device, text, f"entry {name}",
                                                    self.cache_dir, True, self.compile_stats)
        return self.executables[name]

    # ---------------------------------------------------------------- calls

    def _call(self, kind: str, seq: Sequence, feed: list[int]) -> array:
        """One call feeding `feed` to `seq`; its last token's logits (f32)."""
        end = seq.num_cached + len(feed)
        entry = self.art.smallest_entry(kind, 1, end, len(feed))
        if entry is None:
            raise ValueError(f"no {kind} entry holds {len(feed)} tokens reaching position "
                             f"{end - 1}")
        self.blocks.reserve(seq, end)
        bs = self.art.model.block_size
        blocks = pages_for(end, bs)
        row = Row(tuple(feed), seq.num_cached, tuple(seq.pages[:blocks]),
                  tuple(seq.ring[:min(blocks, self.ring_pages)]),
                  -1 if seq.state_slot is None else seq.state_slot)
        t, m = entry.tokens_per_seq, entry.context // bs
        rows = [row_inputs(row, t, m, bs, self.ring_pages)]
        rows += [padding_inputs(t, m, self.ring_pages)] * (entry.batch - 1)
        args, pools = [], []
        for i, spec in enumerate(entry.program.inputs):
            if spec.role == WEIGHT:
                args.append(self.weights[spec.slot])
            elif spec.role in POOL_IN_ROLES:
                args.append(self.pools[spec.pool])
                pools.append(spec.pool)
            elif spec.role == LORA_POOL:
                raise AssertionError("refused at load")
            else:
                args.append(self._step_input(entry.name, spec, rows, row.state_slot))
        before = [self.device.addresses(self.pools[p]) for p in pools]
        outs = self.device.execute(self._executable(entry.name), args)
        del args
        logits = None
        for spec, out in zip(entry.program.outputs, outs):
            if spec.role in POOL_OUT_ROLES:
                self.pools[spec.pool] = out
            elif spec.role == LOGITS:
                logits = self.device.first(out)
        del outs
        moved = sum(b != self.device.addresses(self.pools[p]) for p, b in zip(pools, before))
        self.calls += 1
        self.in_place += not moved
        self.copied += bool(moved)
        seq.num_cached = end
        return _first_row(logits)

    def _step_input(self, entry_name: str, spec, rows: list[RowInputs], state_slot: int):
        """One step input from the rows' values, checked against the program's shape."""
        if spec.role == SEQ_LENS:
            values = [r.seq_len for r in rows]
        elif spec.role == STATE_SLOTS:
            values = [state_slot] + [-1] * (len(rows) - 1)
        elif spec.role in ROW_VALUES:
            values = [v for r in rows for v in getattr(r, ROW_VALUES[spec.role])]
        else:
            raise ArtifactError(f"entry {entry_name}: step input {spec.role} is not built by "
                                f"the standard-library runner")
        if spec.dtype != "i32" or len(values) != math.prod(spec.shape):
            raise ArtifactError(f"entry {entry_name}: {spec.role} must be {spec.dtype} "
                                f"{list(spec.shape)}, the runner built {len(values)} i32 values")
        return self._put([array("i", values)], "i32", spec.shape)

    # ---------------------------------------------------------------- generation

    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                        stop_ids: tuple[int, ...] = ()) -> StdlibResult:
        vocab, max_context = self.art.model.vocab, self.art.max_context
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if not prompt_ids or bad or len(prompt_ids) > max_context:
            raise ValueError(f"a prompt of {len(prompt_ids)} ids (outside [0, {vocab}): {bad}) "
                             f"for contexts up to {max_context}")
        seq = Sequence(list(prompt_ids))
        most = max(e.tokens_per_seq for e in self.art.entries.values() if e.kind == "prefill")
        try:
            t0 = time.perf_counter()
            while seq.num_cached < len(seq.token_ids):
                room = most
                if self.window is not None:  # a call's positions within its ring
                    room = min(room, ring_room(self.ring_pages * self.art.model.block_size,
                                               self.window, seq.num_cached))
                feed = seq.token_ids[seq.num_cached:seq.num_cached + room]
                logits = self._call("prefill", seq, feed)
            first, generated, step_ms = logits, [], []
            prefill_ms = (time.perf_counter() - t0) * 1e3
            reason = "length"
            while True:
                token = _argmax(logits)
                generated.append(token)
                if token in stop_ids:
                    reason = "stop"
                    break
                if len(generated) >= max_new_tokens:
                    break
                if len(seq.token_ids) + 1 > max_context:
                    reason = "context"
                    break
                t0 = time.perf_counter()
                seq.token_ids.append(token)
                logits = self._call("decode", seq, [token])
                step_ms.append((time.perf_counter() - t0) * 1e3)
        finally:
            self.blocks.free(seq)
        return StdlibResult(list(prompt_ids), generated, prefill_ms, step_ms, reason, first)


def _read(path: Path) -> bytearray:
    """A file's bytes, writable (what a buffer is made from)."""
    with open(path, "rb") as f:
        data = bytearray(path.stat().st_size)
        assert f.readinto(data) == len(data), path
    return data


def _first_row(logits) -> array:
    """The first row of a logits buffer [batch, vocab] as f32 values (bf16 widened)."""
    element, vocab = element_name(logits.element_type), logits.dimensions[-1]
    raw = bytearray(tensor_bytes(element, logits.dimensions))
    logits.to_host(memoryview(raw))
    if element == "f32":
        return array("f", raw[:4 * vocab])
    if element == "bf16":  # the high half of an f32
        halves = array("H", raw[:2 * vocab])
        return array("f", array("I", (h << 16 for h in halves)).tobytes())
    raise ArtifactError(f"logits of type {element}: the runner reads f32 or bf16")


def _argmax(values: array) -> int:
    """The first index of the largest value (numpy's argmax)."""
    return max(range(len(values)), key=values.__getitem__)

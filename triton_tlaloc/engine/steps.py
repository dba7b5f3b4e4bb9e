"""Building an entry's step inputs from rows of tokens (rows.py: a row and its values), as
numpy arrays. No JAX, no Triton.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..artifact.manifest import (BLOCK_TABLES, CHUNK, LORA_SLOTS, MIXED, POSITIONS, SEQ_LENS,
                                 SLOT_MAPPING, STATE_SLOTS, STEP_ROLES, TOKEN_IDS,
                                 WINDOW_BLOCK_TABLES, WINDOW_SLOT_MAPPING, WINDOW_STEP_ROLES,
                                 Entry)
from .rows import Row, row_inputs

__all__ = ["Row", "build_mixed_step", "build_step", "one_token_inputs", "row_by_row_inputs"]


def build_mixed_step(entry: Entry, rows: list[Row], chunk: Row, block_size: int,
                     adapters: bool = False, ring_pages: int = 0,
                     state_slots: bool = False) -> dict[str, np.ndarray]:
    """A mixed call's step inputs: the decode rows' as a decode entry of the same batch and
    context takes them, and the chunk's as a one-row prefill entry of the entry's tokens; with
    `adapters`, the decode rows' adapter slots and then the chunk's ([batch + 1]); with
    `ring_pages` (a windowed pool) the window inputs of both; with `state_slots` (state pools)
    the state slots of both."""
    assert entry.kind == MIXED, entry.name
    decode = dataclasses.replace(entry, kind="decode", tokens_per_seq=1)
    step = build_step(decode, rows, block_size, ring_pages, state_slots, adapters)
    prefill = dataclasses.replace(entry, kind="prefill", batch=1)
    chunk_step = build_step(prefill, [chunk], block_size, ring_pages, state_slots, adapters)
    plain = STEP_ROLES + (WINDOW_STEP_ROLES if ring_pages else ()) + (
        (STATE_SLOTS,) if state_slots else ())
    step.update({CHUNK + role: chunk_step[role] for role in plain})
    if adapters:
        step[LORA_SLOTS] = np.concatenate([step[LORA_SLOTS], chunk_step[LORA_SLOTS]])
    return step


def build_step(entry: Entry, rows: list[Row], block_size: int, ring_pages: int = 0,
               state_slots: bool = False, adapters: bool = False) -> dict[str, np.ndarray]:
    """The step inputs of one call; with `ring_pages` (a windowed pool) also the window block
    table (entry b: the ring page of block b) and the window slots; with `state_slots` (state
    pools) each row's state slot; with `adapters` (adapter pools) each row's adapter slot (a
    padding row's 0: none)."""
    assert 1 <= len(rows) <= entry.batch, f"{entry.name}: {len(rows)} rows for batch " \
                                           f"{entry.batch}"
    for row in rows:
        assert 1 <= len(row.tokens) <= entry.tokens_per_seq, \
            f"{entry.name}: a row of {len(row.tokens)} tokens, the entry takes " \
            f"{entry.tokens_per_seq}"
        assert row.end <= entry.context, f"{entry.name}: position {row.end - 1} past its context"
        # A model with only windowed layers holds no full-history pages (its rows have none).
        assert len(row.pages) <= entry.context // block_size and (
            len(row.pages) * block_size >= row.end or (ring_pages and not row.pages)), \
            f"{entry.name}: {len(row.pages)} pages do not hold {row.end} positions"
    if entry.tokens_per_seq == 1:
        step = one_token_inputs(entry, rows, block_size)
    else:
        step = row_by_row_inputs(entry, rows, block_size)
    b, t = entry.batch, entry.tokens_per_seq
    m = entry.context // block_size
    if ring_pages:
        window_tables = np.zeros((b, m), np.int32)
        window_slots = np.full((b, t), -1, np.int32)
        for r, row in enumerate(rows):
            values = row_inputs(row, t, m, block_size, ring_pages)
            window_tables[r] = values.window_table
            window_slots[r] = values.window_slots
        step[WINDOW_BLOCK_TABLES] = window_tables
        step[WINDOW_SLOT_MAPPING] = window_slots
    if state_slots:
        slots = np.full((b,), -1, np.int32)
        for r, row in enumerate(rows):
            assert row.state_slot >= 0, f"{entry.name}: row {r} holds no state slot"
            slots[r] = row.state_slot
        step[STATE_SLOTS] = slots
    if adapters:
        step[LORA_SLOTS] = np.zeros((b,), np.int32)
        step[LORA_SLOTS][:len(rows)] = [row.adapter_slot for row in rows]
    return step


def row_by_row_inputs(entry: Entry, rows: list[Row], block_size: int) -> dict[str, np.ndarray]:
    """The full-history inputs, row by row."""
    b, t = entry.batch, entry.tokens_per_seq
    m = entry.context // block_size
    token_ids = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    slot_mapping = np.full((b, t), -1, np.int32)
    block_tables = np.zeros((b, m), np.int32)
    seq_lens = np.zeros((b,), np.int32)
    for r, row in enumerate(rows):
        values = row_inputs(row, t, m, block_size)
        token_ids[r] = values.token_ids
        positions[r] = values.positions
        slot_mapping[r] = values.slot_mapping
        block_tables[r] = values.block_table
        seq_lens[r] = values.seq_len
    return {TOKEN_IDS: token_ids, POSITIONS: positions, BLOCK_TABLES: block_tables,
            SEQ_LENS: seq_lens, SLOT_MAPPING: slot_mapping}


def one_token_inputs(entry: Entry, rows: list[Row], block_size: int) -> dict[str, np.ndarray]:
    """The same inputs for an entry of one token a row (a decode step), a column at a time:
    a 64-row step took 1.5 ms row by row, which a step of a device's speed cannot hide."""
    b, k = entry.batch, len(rows)
    m = entry.context // block_size
    starts = np.fromiter((row.start for row in rows), np.int64, k)
    token_ids = np.zeros((b, 1), np.int32)
    token_ids[:k, 0] = [row.tokens[0] for row in rows]
    positions = np.zeros((b, 1), np.int32)
    positions[:k, 0] = starts
    seq_lens = np.zeros((b,), np.int32)
    seq_lens[:k] = starts + 1
    block_tables = np.zeros((b, m), np.int32)
    for r, row in enumerate(rows):
        block_tables[r, :len(row.pages)] = row.pages
    slot_mapping = np.full((b, 1), -1, np.int32)
    held = np.fromiter((bool(row.pages) for row in rows), bool, k)
    page = block_tables[np.arange(k), np.minimum(starts // block_size, m - 1)]
    slot_mapping[:k, 0] = np.where(held, page * block_size + starts % block_size, -1)
    return {TOKEN_IDS: token_ids, POSITIONS: positions, BLOCK_TABLES: block_tables,
            SEQ_LENS: seq_lens, SLOT_MAPPING: slot_mapping}

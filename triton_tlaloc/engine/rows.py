"""A row of a call and the values it puts in the call's step inputs, in plain Python (lists of
ints): steps.py writes them into numpy arrays, the runner with no numpy
(runtime/stdlib_runner.py) into `array`s.

A row is one sequence's part of a call: the tokens it feeds, the position of the first, and the
pages the sequence holds. Rows are right-aligned in the token axis: padding first (token 0, the
first token's position, slot -1: never written), then the row's tokens. Rows past the call's own
are padding rows: block table all page 0, length 0, every slot -1, state slot -1 (schema v4: its
state is neither read nor written).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    tokens: tuple[int, ...]
    start: int  # position of tokens[0]
    pages: tuple[int, ...]  # the sequence's pages in logical order
    ring: tuple[int, ...] = ()  # its ring of windowed pages (schema v3): block b on ring[b % R]
    state_slot: int = -1  # its slot in the linear-attention state pools (schema v4)
    adapter_slot: int = 0  # its slot in the adapter pools (model.lora), 0 none

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class RowInputs:
    """One row's values in each step input, `tokens` wide in the token axis and `table`
    wide in the block tables."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_table: list[int]
    seq_len: int
    window_table: list[int] | None = None  # (a windowed pool)
    window_slots: list[int] | None = None


def row_inputs(row: Row, tokens: int, table: int, block_size: int,
               ring_pages: int = 0) -> RowInputs:
    """The values `row` puts in a call whose entry takes `tokens` tokens a row and a block
    table of `table` pages; with `ring_pages` (a windowed pool) its window table (entry b: the
    ring page of block b) and window slots."""
    n = len(row.tokens)
    pad = tokens - n
    positions = range(row.start, row.end)
    # Padding tokens take the first token's position (they are never written and their outputs
    # are dropped): no position in a call is below its earliest real one, which blockwise
    # attention with a window relies on.
    slots = [-1] * pad + ([row.pages[p // block_size] * block_size + p % block_size
                           for p in positions] if row.pages else [-1] * n)
    out = RowInputs([0] * pad + list(row.tokens), [row.start] * pad + list(positions), slots,
                    list(row.pages) + [0] * (table - len(row.pages)), row.end)
    if ring_pages:
        blocks = -(-row.end // block_size)
        ring = row.ring
        assert len(ring) == min(blocks, ring_pages), \
            f"a ring of {len(ring)} pages for {blocks} blocks"
        shown = min(blocks, table)
        out.window_table = [ring[b % len(ring)] for b in range(shown)] + [0] * (table - shown)
        out.window_slots = [-1] * pad + [ring[(p // block_size) % ring_pages] * block_size
                                         + p % block_size for p in positions]
    return out


def padding_inputs(tokens: int, table: int, ring_pages: int = 0) -> RowInputs:
    """A padding row's values: nothing read, nothing written."""
    return RowInputs([0] * tokens, [0] * tokens, [-1] * tokens, [0] * table, 0,
                     [0] * table if ring_pages else None, [-1] * tokens if ring_pages else None)


def ring_room(ring_positions: int, window: int, num_cached: int | None) -> int:
    """The tokens one call may feed a sequence with `num_cached` positions computed (None: any
    sequence whose window is full) within its ring of `ring_positions`: a call of n tokens from
    p0 needs min(p0, window - 1) + n positions of the ring at once
    (docs/design.md#the-windowed-pool); the KV a verify call writes for drafts it rejects then
    overwrites nothing still in the window."""
    before = window - 1 if num_cached is None else min(num_cached, window - 1)
    return ring_positions - before

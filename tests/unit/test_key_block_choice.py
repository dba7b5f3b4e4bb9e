"""Which key blocks an entry's attention may loop in (ExportOptions.key_blocks): prefill entries
their own; decode, verify and mixed entries theirs, and past two rows the many-rows block too,
in whole pages; a block that is not whole pages is refused by name."""

from __future__ import annotations

import pytest

from triton_tlaloc.artifact.manifest import DECODE, MIXED, PREFILL, VERIFY
from triton_tlaloc.export.options import ExportError, ExportOptions


@pytest.mark.parametrize("kind", [DECODE, VERIFY, MIXED])
def test_calls_of_more_than_two_rows_add_the_many_rows_block(kind):
    opts = ExportOptions()
    assert opts.key_blocks(kind, 1) == opts.key_blocks(kind, 2) == (256, 1024)
    assert opts.key_blocks(kind, 4) == opts.key_blocks(kind, 16) == (64, 256, 1024)


def test_prefill_entries_keep_their_blocks_at_any_batch():
    assert ExportOptions().key_blocks(PREFILL, 4) == (256,)


def test_the_default_is_whole_pages_and_zero_turns_it_off():
    assert ExportOptions(block_size=128).key_blocks(DECODE, 4) == (128, 256, 1024)
    assert ExportOptions(many_rows_attention_block=0).key_blocks(DECODE, 16) == (256, 1024)
    assert ExportOptions(many_rows_attention_block=32).key_blocks(DECODE, 4) == (32, 256, 1024)


def test_a_block_that_is_not_whole_pages_is_refused():
    with pytest.raises(ExportError, match="--many-rows-attention-block 40"):
        ExportOptions(many_rows_attention_block=40).validate()

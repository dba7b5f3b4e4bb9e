"""What an export makes: ExportOptions (the ladders, dtypes, pools, attention and layer-loop
choices, every value checked when the options are made) and ExportError, the exporter's refusal."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from .config import DecoderConfig
from . import tensor_parallel
from .quant import QUANT_FORMATS
from ..artifact.manifest import DECODE, PACKED_QUANTS, PREFILL, WindowedKv

WEIGHT_DTYPES = ("f32", "bf16")
# int8, fp8, and the packed ones (manifest.PACKED_QUANTS); OWN_QUANTS keep a checkpoint's own
OWN_QUANTS = ("gguf", "awq", "gptq")
WEIGHT_QUANTS = (*QUANT_FORMATS, *PACKED_QUANTS)
INT4_GROUPS = (32, 128)
KV_DTYPES = {"f32": "f32", "fp8": "f8E4M3FN"}  # --kv-dtype -> the pools' element type
# The key blocks of blockwise attention, in positions, chosen by scripts/bucket_bench.py on the
# CPU (docs/performance.md#attention-that-follows-the-sequence): a smaller block reads less of
# a large bucket the sequence has not filled; a larger one runs fewer loop iterations, which
# a long sequence's decode step gains from (a call takes the largest block it holds more than
# two of) and a prefill call did not (a 7,600-token prompt: 53 s with 1,024 against 39 s).
PREFILL_KEY_BLOCKS = (256,)
DECODE_KEY_BLOCKS = (256, 1024)
# A call of more rows gathers more keys per block: decode, verify and mixed entries of more than
# FEW_ROWS rows also take blocks of this many positions, so a block's keys for every row stay
# in the caches (16 rows at 300 positions, attention of every layer: 86 ms against 113 ms; at
# 40 positions 18 against 59; one row loses with it, its loop steps cost more than the reads;
# docs/performance.md#a-buffer-per-layer-and-a-smaller-key-block-for-many-rows).
MANY_ROWS_KEY_BLOCK = 64
FEW_ROWS = 2


class ExportError(ValueError):
    """Export options or a checkpoint the exporter refuses; the message names the problem."""


def default_prefill_tokens(top: int) -> list[int]:
    """The smaller prefill entries' tokensPerSeq below a largest of `top`: powers of two from
    32, and from 192 also the steps halfway between them in ratio (192, 384, 768, ...). A
    prompt's call costs about its padded tokens past 128 (SmolLM2 f32: 158 tokens took 410 ms
    in a 192-token entry, 517 in a 256-token one), and below that mostly a fixed cost per call
    (30 tokens 183 ms, 62 tokens 276), so finer steps pay only above 128
    (docs/performance.md#2-prefill-a-token-ladder-instead-of-padding-to-the-context)."""
    powers = {2 ** k for k in range(5, top.bit_length())}
    between = {3 * 2 ** k for k in range(6, top.bit_length())}
    return sorted(t for t in powers | between if t < top)


@dataclass(frozen=True)
class ExportOptions:
    batch_ladder: tuple[int, ...] = (1, 2, 4)
    context_ladder: tuple[int, ...] = (64, 256)
    prefill_max_batch: int | None = None  # None: a prefill entry for every batch of the ladder
    block_size: int = 16
    num_blocks: int | None = None  # None: the largest batch at the largest context, plus page 0
    weight_dtype: str = "f32"
    # Each layer's linears as int8 or fp8 codes with an f32 scale per output channel (None:
    # the weight dtype); the embedding, the norms and the head keep the weight dtype.
    weight_quant: str | None = None
    # --weight-quant int4: inputs a scale covers, and whether each group has an offset too
    quant_group: int = 32
    quant_zero_point: bool = False
    # A packed --weight-quant resolved against the checkpoint (packing.slot_quants): each
    # packed slot's type by slot name; set by the exporter, not by a user
    slot_quants: Mapping[str, str] | None = None
    # With weight_quant: the head too (a tied table: the embedding gathers the same codes).
    quant_head: bool = False
    kv_dtype: str = "f32"  # "fp8": e4m3fn KV pools, a quarter of f32's bytes
    model_name: str | None = None
    prefill_chunk: int | None = None  # tokensPerSeq of the prefill entries (None: the context)
    # Smaller prefill entries below the largest, so a short prompt is not padded to a whole
    # context: tokensPerSeq values (None: `default_prefill_tokens`; () none).
    prefill_tokens: tuple[int, ...] | None = None
    # tokensPerSeq of the verify entries (speculative decoding): a sequence's next token and a
    # draft checked in one call; () none. `tlaloc export` asks for 3, 5 and 9 (drafts of 2, 4
    # or 8) by default; here none, because they double a small model's entries and what a
    # runtime compiles. Never for linear-attention models (a state cannot be rewound).
    verify_tokens: tuple[int, ...] = ()
    # tokensPerSeq of the mixed entries: a prompt's chunk of up to this many tokens and every
    # batch of the ladder's decode rows in one call (docs/design.md#mixed-steps); () none.
    # Not written for tensor parallelism (writer._mixed_tokens).
    mixed_tokens: tuple[int, ...] = ()
    # The mixed entries' batches (None: every batch of the ladder; one above the ladder's
    # largest is that): a call of fewer decode rows takes the smallest that holds them
    mixed_batches: tuple[int, ...] | None = None
    # Key blocks of blockwise attention (docs/design.md#paged-attention): an entry whose
    # context spans more than one attends a block at a time, up to the block holding its last
    # live position, so its cost follows what the sequences hold, not the bucket. Prefill
    # entries use `attention_block`; decode and verify entries `decode_attention_block`: a
    # block, or several from which each call takes one by the positions it holds.
    attention_block: int | tuple[int, ...] = PREFILL_KEY_BLOCKS
    decode_attention_block: int | tuple[int, ...] = DECODE_KEY_BLOCKS
    # The block decode, verify and mixed entries of more than FEW_ROWS rows add (0: none)
    many_rows_attention_block: int | None = None  # None: MANY_ROWS_KEY_BLOCK in whole pages
    windowed_kv: bool | None = None  # None: a windowed pool when the model has sliding layers
    ring_spare_pages: int = 1  # pages a ring holds beyond one window
    window_blocks: int | None = None  # pages per windowed pool (None: see `windowed`)
    ring_pages: int | None = None  # override the ring size (tests: a ring one page short)
    # Linear-attention state slots (schema v4): sequences that can hold state at once (None:
    # four times the largest batch).
    state_slots: int | None = None
    # Layers run as one loop over weights and pools stacked over the layers, when the model's
    # layers are alike (decoder.loops_layers); False: unrolled, one set of kernels per layer.
    layer_loop: bool = True
    # A layer loop's f32 linears also stored [in, out], for the products of more than 8 rows
    # (decode batches of 16, prompts, mixed calls): 1.1-1.3x faster calls for a second copy of
    # the linears (decoder.in_out_copies). `tlaloc export` writes it unless --no-in-out-copy.
    in_out_copy: bool = False
    # Devices one instance runs the programs on (docs/design.md#tensor-parallelism): 1, or
    # the programs are lowered for that many, each weight and pool split Megatron style.
    tensor_parallel: int = 1
    # With tensor_parallel: the embedding table and the head split by vocabulary (as vLLM's
    # are; each device reads 1/N of the head a step, the logits are gathered), or copied
    # whole on every device (a vocabulary that does not divide always is).
    replicate_vocab: bool = False
    # LoRA adapters (docs/design.md#lora-adapters): the largest rank an adapter may have (0:
    # the entries take no adapters), and the adapters the device holds at once (the pools'
    # slots besides slot 0, no adapter).
    max_lora_rank: int = 0
    lora_slots: int = 4

    @property
    def linear_quant(self) -> str | Mapping[str, str] | None:
        """What decoder.weight_slots takes: the quantization by name, or each slot's."""
        return self.slot_quants if self.weight_quant in PACKED_QUANTS else self.weight_quant

    def validate(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ExportError(f"--weight-dtype {self.weight_dtype!r}: expected one of "
                              f"{', '.join(WEIGHT_DTYPES)}")
        if self.weight_quant is not None and self.weight_quant not in WEIGHT_QUANTS:
            raise ExportError(f"--weight-quant {self.weight_quant!r}: expected one of "
                              f"{', '.join(WEIGHT_QUANTS)}")
        if self.weight_quant in OWN_QUANTS and self.quant_head:
            raise ExportError(f"--weight-quant {self.weight_quant} keeps the checkpoint's own "
                              f"type for every quantized tensor, the head's too: not with "
                              f"--quant-head")
        if self.weight_quant in PACKED_QUANTS and self.weight_dtype != "f32":
            raise ExportError(f"--weight-quant {self.weight_quant}: packed weights are written "
                              f"with f32 for the rest: not with --weight-dtype "
                              f"{self.weight_dtype}")
        if self.quant_group not in INT4_GROUPS:
            raise ExportError(f"--quant-group {self.quant_group}: expected one of "
                              f"{', '.join(map(str, INT4_GROUPS))}")
        if (self.quant_group != 32 or self.quant_zero_point) and self.weight_quant != "int4":
            raise ExportError("--quant-group and --quant-zero-point shape --weight-quant int4")
        if self.quant_head and self.weight_quant is None:
            raise ExportError("--quant-head quantizes the head like the linears: it needs "
                              "--weight-quant int8 or fp8")
        if self.kv_dtype not in KV_DTYPES:
            raise ExportError(f"--kv-dtype {self.kv_dtype!r}: expected one of "
                              f"{', '.join(KV_DTYPES)}")
        if not self.batch_ladder or min(self.batch_ladder) < 1:
            raise ExportError(f"--batch-ladder {list(self.batch_ladder)}: batches must be >= 1")
        if self.block_size < 1:
            raise ExportError(f"--block-size {self.block_size}: must be >= 1")
        for c in self.context_ladder:
            if c < 1 or c % self.block_size:
                raise ExportError(f"--context-ladder: context {c} is not a positive multiple of "
                                  f"the block size {self.block_size}")
        if self.prefill_max_batch is not None and self.prefill_max_batch < 1:
            raise ExportError("--prefill-max-batch must be >= 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ExportError("--prefill-chunk must be >= 1")
        if self.prefill_tokens is not None and any(t < 1 for t in self.prefill_tokens):
            raise ExportError(f"--prefill-tokens {list(self.prefill_tokens)}: must be >= 1")
        if any(t < 2 for t in self.verify_tokens):
            raise ExportError(f"--verify-tokens {list(self.verify_tokens)}: each must be >= 2 "
                              f"(the sequence's next token and at least one draft token)")
        if any(t < 1 for t in self.mixed_tokens):
            raise ExportError(f"--mixed-tokens {list(self.mixed_tokens)}: each must be >= 1")
        if self.mixed_batches is not None and any(b < 1 for b in self.mixed_batches):
            raise ExportError(f"--mixed-batches {list(self.mixed_batches)}: each must be >= 1")
        if self.max_lora_rank < 0 or self.lora_slots < 1:
            raise ExportError(f"--max-lora-rank {self.max_lora_rank}, --lora-slots "
                              f"{self.lora_slots}: a rank >= 0 (0: no adapters) and at least "
                              f"one slot")
        if self.tensor_parallel < 1:
            raise ExportError(f"--tensor-parallel {self.tensor_parallel}: must be >= 1")
        if self.state_slots is not None and self.state_slots < 1:
            raise ExportError(f"--state-slots {self.state_slots}: must be >= 1")
        for flag, kind in (("--attention-block", PREFILL), ("--decode-attention-block", DECODE)):
            blocks = self.key_blocks(kind)
            if not blocks or any(b < 1 or b % self.block_size for b in blocks):
                raise ExportError(f"{flag} {','.join(map(str, blocks))}: key blocks must be "
                                  f"positive multiples of the block size {self.block_size}")
        if self.many_rows_attention_block is not None and (
                self.many_rows_attention_block < 0
                or self.many_rows_attention_block % self.block_size):
            raise ExportError(f"--many-rows-attention-block {self.many_rows_attention_block}: "
                              f"0, or a multiple of the block size {self.block_size}")

    def windowed(self, cfg: DecoderConfig, num_blocks: int) -> WindowedKv | None:
        """The windowed pool for a model with sliding layers (docs/design.md#the-windowed-pool),
        or None."""
        layers = tuple(i for i in range(cfg.num_layers) if cfg.window(i))
        if not layers or self.windowed_kv is False:
            return None
        windows = {cfg.window(i) for i in layers}
        if len(windows) != 1:
            raise ExportError(f"sliding layers with different windows {sorted(windows)}: one "
                              f"windowed pool needs one window")
        window = windows.pop()
        bs = self.block_size
        most = max(self.context_ladder) // bs
        # One window plus the spare page, or what a chunk written past the window needs.
        ring = -(-window // bs) + self.ring_spare_pages
        if self.prefill_chunk:
            ring = max(ring, -(-(window - 1 + self.prefill_chunk) // bs))
        ring = min(ring, most) if self.ring_pages is None else self.ring_pages
        if ring * bs < window:
            raise ExportError(f"a ring of {ring} pages of {bs} does not hold a window of {window}")
        if self.window_blocks is not None:
            blocks = self.window_blocks
        else:  # as many rings as the full pool holds sequences of the largest context
            blocks = min(num_blocks, max(1, (num_blocks - 1) // most) * ring + 1)
        return WindowedKv(window, layers, ring, blocks)

    def tokens_per_seq(self, context: int) -> int:
        return min(self.prefill_chunk, context) if self.prefill_chunk else context

    def prefill_token_ladder(self, context: int) -> list[int]:
        """tokensPerSeq of the prefill entries at a context, smallest first. A prompt runs in
        the smallest that holds it: prefill's work grows with the tokens computed, padding
        included (SmolLM2 f32: a 40-token prompt took 542 ms in a 256-token entry)."""
        top = self.tokens_per_seq(context)
        below = (self.prefill_tokens if self.prefill_tokens is not None
                 else default_prefill_tokens(top))
        return sorted({t for t in below if t < top} | {top})

    @property
    def kv_type(self) -> str:
        """The KV pools' element type, as StableHLO spells it."""
        return KV_DTYPES[self.kv_dtype]

    def key_blocks(self, kind: str, batch: int = 1) -> tuple[int, ...]:
        """The key blocks of an entry of this kind and batch, ascending: a prefill call's
        tokens share each block's gathered pages; a decode or verify call's few tokens do not,
        and one of more than FEW_ROWS rows also takes the many-rows block."""
        blocks = self.attention_block if kind == PREFILL else self.decode_attention_block
        blocks = set(blocks) if isinstance(blocks, (tuple, list)) else {blocks}
        many_rows = self.resolved_many_rows_block()
        if kind != PREFILL and batch > FEW_ROWS and many_rows:
            blocks.add(many_rows)
        return tuple(sorted(blocks))

    def resolved_many_rows_block(self) -> int:
        """The many-rows key block in positions (0: none); by default MANY_ROWS_KEY_BLOCK
        rounded up to whole pages."""
        if self.many_rows_attention_block is not None:
            return self.many_rows_attention_block
        return -(-MANY_ROWS_KEY_BLOCK // self.block_size) * self.block_size

    def resolved_state_slots(self) -> int:
        return self.state_slots if self.state_slots is not None else 4 * max(self.batch_ladder)

    def resolved_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        # Room for the largest batch at the largest context up to batches of 4 (past 4, for
        # 4 sequences at the largest context, or the largest batch at the smallest, whichever
        # is more: batches of 16 would otherwise take four times the memory), plus page 0,
        # which is never given to a sequence: padding rows' block tables point at it.
        batch, contexts = max(self.batch_ladder), self.context_ladder
        tokens = max(min(batch, 4) * max(contexts), batch * min(contexts))
        return tokens // self.block_size + 1

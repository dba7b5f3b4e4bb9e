"""The Tlaloc serving artifact's format: the manifest's roles and element types, and the
dataclasses an artifact is read into (docs/artifact-format.md). An artifact is a directory:

    tlaloc-serving.json      the manifest (schema tlaloc-serving-v2, v3 or v4)
    bodies/<sha256>.mlir     one StableHLO module per entry, function @main
    programs/<entry>.json    each entry's inputs and outputs with their roles
    weights/NNNN_<slot>.bin  one raw little-endian file per weight tensor, linears [in, out]
    tokenizer/               the checkpoint's tokenizer files (optional)

Reading and checking one is loading.py's `load_artifact`. Nothing here imports JAX.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from .sharding import TensorParallel

MANIFEST_NAME = "tlaloc-serving.json"
SCHEMA_V2 = "tlaloc-serving-v2"
SCHEMA_V3 = "tlaloc-serving-v3"  # v2 plus the windowed KV pool (rings for sliding layers)
SCHEMA_V4 = "tlaloc-serving-v4"  # plus linear-attention state pools (model.linearState)
SUPPORTED_SCHEMAS = (SCHEMA_V2, SCHEMA_V3, SCHEMA_V4)
# Other Tlaloc artifact schemas, which this loader does not serve: refused by name.
KNOWN_UNBUILT_SCHEMAS = {
    "tlaloc-bounded-v1": ("a bounded program is not a language model: it is served by "
                          "`tlaloc repository` as a program model (Triton) or "
                          "triton_tlaloc.programs.bounded.BoundedRuntime (tlaloc-bounded.json)"),
}

# Input roles and output roles (docs/artifact-format.md).
TOKEN_IDS = "TOKEN_IDS"
POSITIONS = "POSITIONS"
BLOCK_TABLES = "BLOCK_TABLES"
SEQ_LENS = "SEQ_LENS"
SLOT_MAPPING = "SLOT_MAPPING"
KV_POOL_IN = "KV_POOL_IN"
WINDOW_BLOCK_TABLES = "WINDOW_BLOCK_TABLES"
WINDOW_SLOT_MAPPING = "WINDOW_SLOT_MAPPING"
WINDOW_KV_POOL_IN = "WINDOW_KV_POOL_IN"
WINDOW_KV_POOL_OUT = "WINDOW_KV_POOL_OUT"
WEIGHT = "WEIGHT"
LOGITS = "LOGITS"  # decode and prefill entries: f32 [B, vocab], each row's last position
# Verify entries (speculative decoding): the argmax and the logits after every position.
POSITION_ARGMAX = "POSITION_ARGMAX"  # i32 [B, T]
POSITION_LOGITS = "POSITION_LOGITS"  # f32 [B, T, vocab]
# a mixture of experts' entries: i32 [sparse layers, experts], the (token, expert) pairs each
# sparse layer routed to each expert in the call, padding tokens not counted
EXPERT_LOAD = "EXPERT_LOAD"
KV_POOL_OUT = "KV_POOL_OUT"
STATE_SLOTS = "STATE_SLOTS"  # [B]: each row's slot in the state pools, -1 for a padding row
STATE_POOL_IN = "STATE_POOL_IN"
STATE_POOL_OUT = "STATE_POOL_OUT"
# LoRA adapters (model.lora): each row's slot in the adapter pools, 0 for none or a padding
# row; the pools, read by the entries and written only by the runtime between calls
LORA_SLOTS = "LORA_SLOTS"
LORA_POOL = "LORA_POOL"
STEP_ROLES = (TOKEN_IDS, POSITIONS, BLOCK_TABLES, SEQ_LENS, SLOT_MAPPING)
WINDOW_STEP_ROLES = (WINDOW_BLOCK_TABLES, WINDOW_SLOT_MAPPING)
STATE_STEP_ROLES = (STATE_SLOTS,)
POOL_IN_ROLES = (KV_POOL_IN, WINDOW_KV_POOL_IN, STATE_POOL_IN)
POOL_OUT_ROLES = (KV_POOL_OUT, WINDOW_KV_POOL_OUT, STATE_POOL_OUT)
# Each pool output with the input it is donated from.
DONATION_ROLES = ((KV_POOL_OUT, KV_POOL_IN), (WINDOW_KV_POOL_OUT, WINDOW_KV_POOL_IN),
                  (STATE_POOL_OUT, STATE_POOL_IN))
LORA_STEP_ROLES = (LORA_SLOTS,)
# Mixed entries: besides the decode rows' step inputs (the roles above, [R, 1] and [R, pages]),
# one prompt chunk's own, [1, T] and [1, pages] (with a windowed pool its window table and
# ring slots, with state pools its state slot [1]), each role CHUNK + the plain role
# (docs/artifact-format.md#mixed-entries)
CHUNK = "CHUNK_"
CHUNK_ROLES = tuple(CHUNK + role for role in STEP_ROLES + WINDOW_STEP_ROLES + STATE_STEP_ROLES)
INPUT_ROLES = (STEP_ROLES + WINDOW_STEP_ROLES + STATE_STEP_ROLES + LORA_STEP_ROLES
               + CHUNK_ROLES + POOL_IN_ROLES + (LORA_POOL, WEIGHT))
OUTPUT_ROLES = (LOGITS, POSITION_ARGMAX, POSITION_LOGITS, EXPERT_LOAD) + POOL_OUT_ROLES

# Entry kinds. A verify entry feeds a sequence its next token and draft tokens in one call and
# returns what the model predicts after each of them (speculative decoding;
# docs/artifact-format.md#verify-entries-speculative-decoding).
# A mixed entry runs `batch` decode rows and one prompt chunk of up to `tokensPerSeq` tokens in
# one call: the linears over all the tokens at once, attention per group
# (docs/artifact-format.md#mixed-entries).
DECODE, PREFILL, VERIFY, MIXED = "decode", "prefill", "verify", "mixed"
ENTRY_KINDS = (DECODE, PREFILL, VERIFY, MIXED)

# Element types, spelled as StableHLO spells them, with their numpy dtypes.
_NUMPY_DTYPES = {
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
    "i32": "int32",
    "i64": "int64",
    "i16": "int16",
    "i8": "int8",
    "ui8": "uint8",
    "ui16": "uint16",
    "ui32": "uint32",
    "i1": "bool",
    "f8E4M3FN": "float8_e4m3fn",
}
# Bytes an element of each type takes (what the runtime with no numpy sizes buffers by)
ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4, "i64": 8, "i16": 2, "i8": 1,
                 "ui8": 1, "ui16": 2, "ui32": 4, "i1": 1, "f8E4M3FN": 1}


# A tensor a program may take as its bits: unsigned integers of the same width, which the program
# bitcasts to the tensor's own type where it reads it. XLA's CPU backend has no dynamic slice,
# gather or scatter of bf16 or f8 values: given the layer loop's stacked bf16 weights it widens
# every layer to f32 on each call before slicing one out, and given an f8 pool it copies the
# whole pool on the way in and out, where a slice of integers is read in place
# (docs/artifact-format.md#tensors-taken-as-their-bits).
BITS = {"bf16": "ui16", "f8E4M3FN": "ui8"}


def takes_as(program_dtype: str, stored_dtype: str) -> bool:
    """Whether a program's `program_dtype` takes a weight or pool stored as `stored_dtype`: the
    same type, or its bits (BITS)."""
    return program_dtype in (stored_dtype, BITS.get(stored_dtype))


def element_bytes(name: str) -> int:
    """Bytes one element of a StableHLO element type takes."""
    if name not in ELEMENT_BYTES:
        raise ArtifactError(f"unknown element type {name!r} (known: {', '.join(ELEMENT_BYTES)})")
    return ELEMENT_BYTES[name]


def tensor_bytes(name: str, shape) -> int:
    """Bytes a tensor of an element type and shape takes."""
    return math.prod(shape) * element_bytes(name)


def numpy_dtype(name: str):
    """The numpy dtype of a StableHLO element type name (bf16 and f8 come from ml_dtypes)."""
    import numpy as np  # (only here: an artifact is read with no numpy too)

    if name not in _NUMPY_DTYPES:
        raise ArtifactError(f"unknown element type {name!r} (known: {', '.join(_NUMPY_DTYPES)})")
    np_name = _NUMPY_DTYPES[name]
    if np_name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, np_name))
    return np.dtype(np_name)


def dtype_name(dtype) -> str:
    """The StableHLO element type name of a numpy dtype."""
    import numpy as np

    dtype = np.dtype(dtype)
    for name, np_name in _NUMPY_DTYPES.items():
        if dtype.name == np_name:
            return name
    raise ArtifactError(f"no StableHLO element type for numpy dtype {dtype}")


class ArtifactError(ValueError):
    """An artifact that cannot be served; the message names the problem and the file."""


@dataclass(frozen=True)
class TensorSpec:
    """One parameter or result of an entry's @main."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    slot: str | None = None  # WEIGHT inputs: the weight slot
    pool: str | None = None  # KV_POOL_IN / KV_POOL_OUT: the pool's name

    @property
    def type_text(self) -> str:
        """The StableHLO type, e.g. tensor<1x64xi32>."""
        dims = "x".join(str(d) for d in self.shape)
        return f"tensor<{dims}x{self.dtype}>" if dims else f"tensor<{self.dtype}>"

    def to_json(self) -> dict:
        out = {"name": self.name, "role": self.role, "dtype": self.dtype, "shape": list(self.shape)}
        if self.slot is not None:
            out["slot"] = self.slot
        if self.pool is not None:
            out["pool"] = self.pool
        return out

    @staticmethod
    def from_json(obj: dict) -> "TensorSpec":
        return TensorSpec(
            name=obj["name"],
            role=obj["role"],
            dtype=obj["dtype"],
            shape=tuple(int(d) for d in obj["shape"]),
            slot=obj.get("slot"),
            pool=obj.get("pool"),
        )


def leading_outputs(kind: str, batch: int, tokens: int, vocab: int,
                    experts: tuple[int, int] | None = None) -> tuple[TensorSpec, ...]:
    """The outputs an entry of a kind returns before its pools, in order: a decode or prefill
    entry each row's last logits; a verify entry the argmax and the logits after each of the
    row's positions; then, for a mixture of experts (`experts`: its sparse layers and
    experts), the call's expert load. A mixed entry's logits are its decode rows' and then its
    chunk's last token's: `batch` + 1 rows."""
    if kind == VERIFY:
        out = (TensorSpec("position_argmax", POSITION_ARGMAX, "i32", (batch, tokens)),
               TensorSpec("position_logits", POSITION_LOGITS, "f32", (batch, tokens, vocab)))
    else:
        rows = batch + 1 if kind == MIXED else batch
        out = (TensorSpec("logits", LOGITS, "f32", (rows, vocab)),)
    if experts is not None:
        out += (TensorSpec("expert_load", EXPERT_LOAD, "i32", experts),)
    return out


@dataclass(frozen=True)
class Program:
    """An entry's signature: inputs and outputs in @main's order, and the donation pairs."""

    entry: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    donation: tuple[tuple[int, int], ...]  # (output index, input index)

    def to_json(self) -> dict:
        return {
            "entry": self.entry,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "donation": [{"output": o, "input": i} for o, i in self.donation],
        }

    @staticmethod
    def from_json(obj: dict) -> "Program":
        return Program(
            entry=obj["entry"],
            inputs=tuple(TensorSpec.from_json(s) for s in obj["inputs"]),
            outputs=tuple(TensorSpec.from_json(s) for s in obj["outputs"]),
            donation=tuple((int(d["output"]), int(d["input"])) for d in obj.get("donation", [])),
        )


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "decode" | "prefill" | "verify" | "mixed"
    batch: int
    context: int
    tokens_per_seq: int
    body: str  # path relative to the artifact
    sha256: str
    program_path: str
    program: Program

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "batch": self.batch,
            "context": self.context,
            "tokensPerSeq": self.tokens_per_seq,
            "body": self.body,
            "sha256": self.sha256,
            "program": self.program_path,
        }


@dataclass(frozen=True)
class WeightFile:
    slot: str
    dtype: str
    shape: tuple[int, ...]
    byte_length: int
    file: str
    # One of a packed weight's arrays (docs/artifact-format.md#gguf-packed-weights): the packed
    # type's name ("Q4_1", "INT4_G32", "B6_G16_Z32_O"); None for values of `dtype`
    quant: str | None = None

    def to_json(self) -> dict:
        out = {
            "slot": self.slot,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "byteLength": self.byte_length,
            "file": self.file,
        }
        if self.quant is not None:
            out["quant"] = self.quant
        return out


# model.weightQuant values whose weights are packed (export/packing.py): gguf, a GGUF file's
# quantized tensors in their own types; awq and gptq, such a checkpoint's 4-bit linears as they
# are; int4, 4-bit codes with a scale per group quantized at export
PACKED_QUANTS = ("gguf", "awq", "gptq", "int4")


@dataclass(frozen=True)
class ModelShape:
    family: str
    model_name: str
    model_hash: str
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    hidden_size: int
    intermediate_size: int
    vocab: int
    block_size: int
    num_blocks: int
    weight_dtype: str
    kv_dtype: str
    max_positions: int
    refused_tokens: tuple[dict, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # "int8" | "fp8": the layers' linears as codes + scales; one of PACKED_QUANTS: packed
    # weights, each weight file's type in WeightFile.quant
    weight_quant: str | None = None
    head_quant: bool = False  # the head (a tied table) quantized too
    # packed weights: how the codes are packed (gguf_packed.PACKED_LAYOUT, "row-bands"); a
    # device may want another, so the artifact says which its programs read
    packed_layout: str | None = None
    # a mixture of experts (model.experts): (its sparse layers, its experts) for the entries'
    # expert load output
    experts: tuple[int, int] | None = None

    @property
    def packed(self) -> bool:
        """Whether the weights are packed (weight_quant one of PACKED_QUANTS)."""
        return self.weight_quant in PACKED_QUANTS

    @property
    def quantized(self) -> str:
        """What is quantized, for logs ("linears and head int8"); empty when nothing is."""
        if not self.weight_quant:
            return ""
        if self.packed and self.weight_quant != "int4":
            return f"{self.weight_quant.upper()} types kept packed"
        if self.weight_quant == "int4":
            return f"linears{' and head' if self.head_quant else ''} int4, packed"
        return f"linears{' and head' if self.head_quant else ''} {self.weight_quant}"

    def to_json(self) -> dict:
        return {
            "family": self.family,
            "modelName": self.model_name,
            "modelHash": self.model_hash,
            "layers": self.layers,
            "heads": self.heads,
            "kvHeads": self.kv_heads,
            "headSize": self.head_size,
            "hiddenSize": self.hidden_size,
            "intermediateSize": self.intermediate_size,
            "vocab": self.vocab,
            "blockSize": self.block_size,
            "numBlocks": self.num_blocks,
            "weightDtype": self.weight_dtype,
            "weightQuant": self.weight_quant,
            "headQuant": self.head_quant,
            "kvDtype": self.kv_dtype,
            "maxPositions": self.max_positions,
            "refusedTokens": list(self.refused_tokens),
            "eosTokenIds": list(self.eos_token_ids),
            "bosTokenId": self.bos_token_id,
        }

    @staticmethod
    def from_json(obj: dict) -> "ModelShape":
        return ModelShape(
            family=obj["family"],
            model_name=obj["modelName"],
            model_hash=obj.get("modelHash", ""),
            layers=int(obj["layers"]),
            heads=int(obj["heads"]),
            kv_heads=int(obj["kvHeads"]),
            head_size=int(obj["headSize"]),
            hidden_size=int(obj["hiddenSize"]),
            intermediate_size=int(obj["intermediateSize"]),
            vocab=int(obj["vocab"]),
            block_size=int(obj["blockSize"]),
            num_blocks=int(obj["numBlocks"]),
            weight_dtype=obj["weightDtype"],
            kv_dtype=obj["kvDtype"],
            max_positions=int(obj.get("maxPositions", 0)),
            refused_tokens=tuple(obj.get("refusedTokens", [])),
            eos_token_ids=tuple(int(t) for t in obj.get("eosTokenIds", [])),
            bos_token_id=obj.get("bosTokenId"),
            weight_quant=obj.get("weightQuant"),
            head_quant=bool(obj.get("headQuant", False)),
            packed_layout=obj.get("packedLayout"),
            experts=(len(obj["experts"]["layers"]), int(obj["experts"]["numExperts"]))
            if obj.get("experts") else None,
        )


@dataclass(frozen=True)
class KvPool:
    """One pool of pages: numBlocks pages of blockSize tokens, for one layer's K or V, or (an
    artifact whose layers run as a loop) for every layer's, stacked on the second axis."""

    name: str
    layer: int  # the first layer it holds
    kind: str  # "k" | "v"
    dtype: str
    shape: tuple[int, ...]  # [numBlocks, (layers,) blockSize, kvHeads, headSize]
    pool_class: str = "full"  # "full" | "windowed" (a sliding layer's rings, schema v3)
    stacked_layers: int = 1  # layers held on axis 1; 1: one layer, no such axis

    def to_json(self) -> dict:
        out = {"name": self.name, "layer": self.layer, "kind": self.kind, "dtype": self.dtype,
               "shape": list(self.shape), "class": self.pool_class}
        if self.stacked_layers > 1:
            out["stackedLayers"] = self.stacked_layers
        return out


@dataclass(frozen=True)
class WindowedKv:
    """The windowed KV pool (schema v3): each sequence holds a ring of at most ring_pages pages;
    logical block b lives on ring page b % ring_pages."""

    window: int
    layers: tuple[int, ...]
    ring_pages: int
    num_blocks: int  # pages in each windowed pool, page 0 never given to a sequence

    def to_json(self) -> dict:
        return {"window": self.window, "layers": list(self.layers), "ringPages": self.ring_pages,
                "numBlocks": self.num_blocks}


@dataclass(frozen=True)
class StatePool:
    """One linear layer's conv or recurrent states, one per state slot (schema v4)."""

    name: str
    layer: int
    kind: str  # "conv" [slots, kernel - 1, channels] | "recurrent" [slots, heads, key, value]
    dtype: str
    shape: tuple[int, ...]

    @property
    def bytes_per_slot(self) -> int:
        return tensor_bytes(self.dtype, self.shape[1:])

    def to_json(self) -> dict:
        return {"name": self.name, "layer": self.layer, "kind": self.kind, "dtype": self.dtype,
                "shape": list(self.shape)}


@dataclass(frozen=True)
class LinearState:
    """The linear-attention state pools (schema v4, model.linearState): each sequence holds one
    state slot for its life, in every pool; a row starting at position 0 starts from zero
    state, so a freed slot is reused without clearing."""

    layers: tuple[int, ...]
    num_slots: int
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    pools: tuple[StatePool, ...]

    @property
    def bytes_per_slot(self) -> int:
        """The state memory of one sequence, whatever its context."""
        return sum(p.bytes_per_slot for p in self.pools)

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "numSlots": self.num_slots,
                "convKernel": self.conv_kernel, "numKeyHeads": self.num_key_heads,
                "numValueHeads": self.num_value_heads, "keyHeadDim": self.key_head_dim,
                "valueHeadDim": self.value_head_dim, "bytesPerSlot": self.bytes_per_slot,
                "pools": [p.to_json() for p in self.pools]}

    @staticmethod
    def from_json(obj: dict) -> "LinearState":
        return LinearState(
            layers=tuple(int(x) for x in obj["layers"]), num_slots=int(obj["numSlots"]),
            conv_kernel=int(obj["convKernel"]), num_key_heads=int(obj["numKeyHeads"]),
            num_value_heads=int(obj["numValueHeads"]), key_head_dim=int(obj["keyHeadDim"]),
            value_head_dim=int(obj["valueHeadDim"]),
            pools=tuple(StatePool(p["name"], int(p["layer"]), p["kind"], p["dtype"],
                                  tuple(int(d) for d in p["shape"])) for p in obj["pools"]))


@dataclass
class Artifact:
    path: Path
    schema: str
    model: ModelShape
    batch_ladder: tuple[int, ...]
    context_ladder: tuple[int, ...]
    entries: dict[str, Entry]
    weights: tuple[WeightFile, ...]
    pools: tuple[KvPool, ...]
    manifest: dict = field(repr=False, default_factory=dict)
    windowed: WindowedKv | None = None
    linear_state: LinearState | None = None
    tensor_parallel: TensorParallel | None = None  # model.tensorParallel: programs for N devices
    # Each weight slot's and KV pool's dtype as the programs take it (its own, or its bits:
    # BITS), alike in every entry: the loader fills them as it checks each program.
    weight_inputs: dict[str, str] = field(default_factory=dict, repr=False)
    pool_inputs: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def devices(self) -> int:
        """The devices one instance runs the programs on."""
        return self.tensor_parallel.devices if self.tensor_parallel is not None else 1

    @functools.cached_property
    def lora(self):
        """The adapter pools the entries read (model.lora: lora.layout.LoraLayout), or None."""
        from ..lora.layout import LoraLayout

        obj = self.manifest.get("model", {}).get("lora")
        return LoraLayout.from_json(obj) if obj else None

    def pool_axis(self, name: str) -> int | None:
        """The axis a pool is split along over the devices (None on one device)."""
        tp = self.tensor_parallel
        return tp.partition_axis(name, pool=True) if tp is not None else None

    @property
    def state_pools(self) -> tuple[StatePool, ...]:
        return self.linear_state.pools if self.linear_state is not None else ()

    def weight_input_dtypes(self) -> dict[str, str]:
        """Each weight slot's dtype as the device holds it: as the programs take it, the file's
        own or its bits (BITS), so one buffer serves every entry."""
        return {w.slot: self.weight_inputs.get(w.slot, w.dtype) for w in self.weights}

    def pool_input_dtypes(self) -> dict[str, str]:
        """Each KV and state pool's dtype as the device holds it: its own, or its bits."""
        return {p.name: self.pool_inputs.get(p.name, p.dtype)
                for p in (*self.pools, *self.state_pools)}

    def entries_of(self, kind: str) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.kind == kind),
                      key=lambda e: (e.context, e.batch))

    def smallest_entry(self, kind: str, batch: int, context: int, tokens: int = 1,
                       among=None) -> Entry | None:
        """The smallest entry of a kind (of those named in `among`, default all) that holds
        `batch` rows of `tokens` tokens reaching position `context - 1`: smallest context first
        (the work grows with it), then batch."""
        fits = [e for e in self.entries.values()
                if (among is None or e.name in among) and e.kind == kind and e.batch >= batch
                and e.context >= context and e.tokens_per_seq >= tokens]
        return min(fits, key=lambda e: (e.context, e.batch, e.tokens_per_seq), default=None)

    @property
    def verify_tokens(self) -> tuple[int, ...]:
        """tokensPerSeq of the verify entries, ascending: the calls a speculative step can
        make (a draft of t - 1 tokens after the sequence's next one); empty when none."""
        return tuple(sorted({e.tokens_per_seq for e in self.entries.values()
                             if e.kind == VERIFY}))

    @property
    def max_context(self) -> int:
        return max(self.context_ladder)

    @property
    def tokenizer_dir(self) -> Path | None:
        p = self.path / "tokenizer"
        return p if p.is_dir() else None

    def body_text(self, entry: Entry) -> str:
        return (self.path / entry.body).read_text()

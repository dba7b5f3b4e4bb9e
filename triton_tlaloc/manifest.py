"""The Tlaloc serving artifact: its manifest, its programs, and the checks a loader makes.

An artifact is a directory (docs/artifact-format.md):

    tlaloc-serving.json      the manifest (schema tlaloc-serving-v2, v3 or v4)
    bodies/<sha256>.mlir     one StableHLO module per entry, function @main
    programs/<entry>.json    each entry's inputs and outputs with their roles
    weights/NNNN_<slot>.bin  one raw little-endian file per weight tensor, linears [in, out]
    tokenizer/               the checkpoint's tokenizer files (optional)

`load_artifact` reads and validates one; every refusal is an `ArtifactError` that names the
problem and the file. Nothing here imports JAX: the repository writer and the backend's
configuration step validate artifacts without compiling them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .sharding import TensorParallel
from .stablehlo import MainSignature, num_partitions, parse_main_signature

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
KV_POOL_OUT = "KV_POOL_OUT"
STATE_SLOTS = "STATE_SLOTS"  # [B]: each row's slot in the state pools, -1 for a padding row
STATE_POOL_IN = "STATE_POOL_IN"
STATE_POOL_OUT = "STATE_POOL_OUT"
STEP_ROLES = (TOKEN_IDS, POSITIONS, BLOCK_TABLES, SEQ_LENS, SLOT_MAPPING)
WINDOW_STEP_ROLES = (WINDOW_BLOCK_TABLES, WINDOW_SLOT_MAPPING)
STATE_STEP_ROLES = (STATE_SLOTS,)
POOL_IN_ROLES = (KV_POOL_IN, WINDOW_KV_POOL_IN, STATE_POOL_IN)
POOL_OUT_ROLES = (KV_POOL_OUT, WINDOW_KV_POOL_OUT, STATE_POOL_OUT)
# Each pool output with the input it is donated from.
DONATION_ROLES = ((KV_POOL_OUT, KV_POOL_IN), (WINDOW_KV_POOL_OUT, WINDOW_KV_POOL_IN),
                  (STATE_POOL_OUT, STATE_POOL_IN))
INPUT_ROLES = STEP_ROLES + WINDOW_STEP_ROLES + STATE_STEP_ROLES + POOL_IN_ROLES + (WEIGHT,)
OUTPUT_ROLES = (LOGITS, POSITION_ARGMAX, POSITION_LOGITS) + POOL_OUT_ROLES

# Entry kinds. A verify entry feeds a sequence its next token and draft tokens in one call and
# returns what the model predicts after each of them (speculative decoding;
# docs/artifact-format.md#verify-entries-speculative-decoding).
DECODE, PREFILL, VERIFY = "decode", "prefill", "verify"
ENTRY_KINDS = (DECODE, PREFILL, VERIFY)

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
    "ui32": "uint32",
    "i1": "bool",
    "f8E4M3FN": "float8_e4m3fn",
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a StableHLO element type name (bf16 and f8 come from ml_dtypes)."""
    if name not in _NUMPY_DTYPES:
        raise ArtifactError(f"unknown element type {name!r} (known: {', '.join(_NUMPY_DTYPES)})")
    np_name = _NUMPY_DTYPES[name]
    if np_name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, np_name))
    return np.dtype(np_name)


def dtype_name(dtype) -> str:
    """The StableHLO element type name of a numpy dtype."""
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


def leading_outputs(kind: str, batch: int, tokens: int, vocab: int) -> tuple[TensorSpec, ...]:
    """The outputs an entry of a kind returns before its pools, in order: a decode or prefill
    entry each row's last logits; a verify entry the argmax and the logits after each of the
    row's positions."""
    if kind == VERIFY:
        return (TensorSpec("position_argmax", POSITION_ARGMAX, "i32", (batch, tokens)),
                TensorSpec("position_logits", POSITION_LOGITS, "f32", (batch, tokens, vocab)))
    return (TensorSpec("logits", LOGITS, "f32", (batch, vocab)),)


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
    kind: str  # "decode" | "prefill" | "verify"
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

    def to_json(self) -> dict:
        return {
            "slot": self.slot,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "byteLength": self.byte_length,
            "file": self.file,
        }


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
    weight_quant: str | None = None  # "int8" | "fp8": the layers' linears as codes + scales
    head_quant: bool = False  # the head (a tied table) quantized too

    @property
    def quantized(self) -> str:
        """What is quantized, for logs ("linears and head int8"); empty when nothing is."""
        if not self.weight_quant:
            return ""
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
        return int(np.prod(self.shape[1:], dtype=np.int64)) * numpy_dtype(self.dtype).itemsize

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

    @property
    def devices(self) -> int:
        """The devices one instance runs the programs on."""
        return self.tensor_parallel.devices if self.tensor_parallel is not None else 1

    def pool_axis(self, name: str) -> int | None:
        """The axis a pool is split along over the devices (None on one device)."""
        tp = self.tensor_parallel
        return tp.partition_axis(name, pool=True) if tp is not None else None

    @property
    def state_pools(self) -> tuple[StatePool, ...]:
        return self.linear_state.pools if self.linear_state is not None else ()

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


# --------------------------------------------------------------------------- loading

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _refuse(msg: str, file: Path | str) -> ArtifactError:
    return ArtifactError(f"{msg} ({file})")


def load_artifact(path: str | os.PathLike, *, check_bodies: bool = True) -> Artifact:
    """Read an artifact and validate it; raises ArtifactError naming the problem and the file.

    Checks: the schema version; that every named file exists; every body's sha256; every weight
    file's byte length against its dtype and shape; every body's @main signature against its
    program; every donation pair's shapes and dtypes, and that the body aliases exactly those.
    """
    root = Path(path)
    mpath = root / MANIFEST_NAME
    manifest = _read_manifest(mpath)
    art = _parse_manifest(root, mpath, manifest)
    _check_pool_layout(art, mpath)
    _check_weight_files(root, mpath, art.weights)
    weights = {w.slot: w for w in art.weights}
    pools = {p.name: p for p in art.pools}
    state_pools = {p.name: p for p in art.state_pools}
    _check_tensor_parallel(art.tensor_parallel, weights, {**pools, **state_pools}, mpath)
    program_shapes = {w.slot: _program_shape(art.tensor_parallel, w) for w in art.weights}
    for raw in manifest["entries"]:
        entry = _read_entry(root, mpath, raw)
        _check_program(entry, art.model, weights, pools, state_pools, root / entry.program_path,
                       program_shapes)
        if check_bodies:
            _check_body(entry, root / entry.body, art.devices)
        art.entries[entry.name] = entry
    if not art.entries:
        raise _refuse("the manifest has no entries", mpath)
    return art


def _read_manifest(mpath: Path) -> dict:
    """The manifest's JSON, of a schema this backend serves."""
    if not mpath.is_file():
        raise _refuse("not a Tlaloc serving artifact: no manifest", mpath)
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise _refuse(f"the manifest is not valid JSON: {e}", mpath) from None
    schema = manifest.get("schema")
    if schema in KNOWN_UNBUILT_SCHEMAS:
        raise _refuse(f"schema {schema} is refused: {KNOWN_UNBUILT_SCHEMAS[schema]}; "
                      f"this backend serves {', '.join(SUPPORTED_SCHEMAS)}", mpath)
    if schema not in SUPPORTED_SCHEMAS:
        raise _refuse(f"unknown schema version {schema!r}; this backend serves "
                      f"{', '.join(SUPPORTED_SCHEMAS)}", mpath)
    return manifest


def _parse_manifest(root: Path, mpath: Path, manifest: dict) -> Artifact:
    """The manifest's fields as an Artifact with no entries yet; a missing or malformed field
    is refused by name."""
    try:
        model = ModelShape.from_json(manifest["model"])
        buckets = manifest["buckets"]
        batch_ladder = tuple(int(b) for b in buckets["batchLadder"])
        context_ladder = tuple(int(c) for c in buckets["contextLadder"])
        pools = tuple(KvPool(p["name"], int(p["layer"]), p["kind"], p["dtype"], tuple(p["shape"]),
                             p.get("class", "full"), int(p.get("stackedLayers", 1)))
                      for p in manifest["kvPool"]["pools"])
        wk = manifest["model"].get("windowedKv")
        windowed = None if wk is None else WindowedKv(
            int(wk["window"]), tuple(int(x) for x in wk["layers"]), int(wk["ringPages"]),
            int(wk["numBlocks"]))
        ls = manifest["model"].get("linearState")
        linear_state = None if ls is None else LinearState.from_json(ls)
        tp = manifest["model"].get("tensorParallel")
        tensor_parallel = None if tp is None else TensorParallel.from_json(tp)
        weights = tuple(WeightFile(w["slot"], w["dtype"], tuple(int(d) for d in w["shape"]),
                                   int(w["byteLength"]), w["file"]) for w in manifest["weights"])
        if not isinstance(manifest["entries"], list):
            raise TypeError("entries is not a list")
    except (KeyError, TypeError, ValueError) as e:
        raise _refuse(f"the manifest is missing or has a malformed field: {e!r}", mpath) from None
    return Artifact(root, manifest["schema"], model, batch_ladder, context_ladder, {}, weights,
                    pools, manifest, windowed, linear_state, tensor_parallel)


def _check_pool_layout(art: Artifact, mpath: Path) -> None:
    """The windowed pool and the state pools go with their schemas, and each can serve."""
    schema, windowed, linear_state = art.schema, art.windowed, art.linear_state
    if schema == SCHEMA_V3 and windowed is None:
        raise _refuse("schema tlaloc-serving-v3 needs model.windowedKv (window, layers, "
                      "ringPages, numBlocks)", mpath)
    if schema == SCHEMA_V2 and (windowed is not None
                                or any(p.pool_class == "windowed" for p in art.pools)):
        raise _refuse("a windowed KV pool needs schema tlaloc-serving-v3", mpath)
    if schema == SCHEMA_V4 and linear_state is None:
        raise _refuse("schema tlaloc-serving-v4 needs model.linearState (layers, numSlots, "
                      "pools)", mpath)
    if schema != SCHEMA_V4 and linear_state is not None:
        raise _refuse("linear-attention state pools (model.linearState) need schema "
                      "tlaloc-serving-v4", mpath)
    if linear_state is not None:
        _check_linear_state(linear_state, mpath)
    if windowed is not None and not (1 <= windowed.ring_pages and windowed.num_blocks >= 2):
        raise _refuse(f"model.windowedKv: ringPages {windowed.ring_pages} and numBlocks "
                      f"{windowed.num_blocks} cannot hold a ring", mpath)


def _check_tensor_parallel(tp: TensorParallel | None, weights: dict[str, WeightFile],
                           pools: dict, mpath: Path) -> None:
    """model.tensorParallel: at least 2 devices; every split names a weight slot or a pool and
    cuts it into equal shards; every pool is split (each device holds its heads' pages)."""
    if tp is None:
        return
    if tp.devices < 2:
        raise _refuse(f"model.tensorParallel: devices {tp.devices}; a tensor-parallel "
                      f"artifact runs on 2 or more", mpath)
    for kind, splits, known in (("weight slot", tp.weights, weights), ("pool", tp.pools, pools)):
        for name, split in splits.items():
            if name not in known:
                raise _refuse(f"model.tensorParallel: {kind} {name} is not in the artifact",
                              mpath)
            try:
                split.check(known[name].shape, tp.devices, f"{kind} {name}")
            except ValueError as e:
                raise _refuse(f"model.tensorParallel: {e}", mpath) from None
    unsplit = sorted(set(pools) - set(tp.pools))
    if unsplit:
        raise _refuse(f"model.tensorParallel: pools {unsplit} have no split", mpath)


def _program_shape(tp: TensorParallel | None, w: WeightFile) -> tuple[int, ...]:
    """A weight's shape as the programs see it: a split weight's segments with their copies."""
    split = tp.weights.get(w.slot) if tp is not None else None
    return w.shape if split is None else split.program_shape(w.shape)


def _check_weight_files(root: Path, mpath: Path, weights: tuple[WeightFile, ...]) -> None:
    """Each weight file exists and holds exactly dtype x shape bytes."""
    for w in weights:
        wpath = root / w.file
        if not wpath.is_file():
            raise _refuse(f"weight slot {w.slot}: file is missing", wpath)
        expected = int(np.prod(w.shape, dtype=np.int64)) * numpy_dtype(w.dtype).itemsize
        if w.byte_length != expected:
            raise _refuse(f"weight slot {w.slot}: manifest byteLength {w.byte_length} is not "
                          f"{w.dtype} {list(w.shape)} = {expected} bytes", mpath)
        size = wpath.stat().st_size
        if size != w.byte_length:
            raise _refuse(f"weight slot {w.slot}: file holds {size} bytes, the manifest says "
                          f"{w.byte_length}", wpath)


def _read_entry(root: Path, mpath: Path, e) -> Entry:
    """One manifest entry with its program; its files must exist."""
    name = e.get("name", "?") if isinstance(e, dict) else "?"
    missing = [k for k in ("name", "kind", "batch", "context", "tokensPerSeq", "body",
                           "sha256", "program") if not isinstance(e, dict) or k not in e]
    if missing:
        raise _refuse(f"entry {name}: missing field(s) {', '.join(missing)}", mpath)
    body_path = root / e["body"]
    prog_path = root / e["program"]
    for p in (body_path, prog_path):
        if not p.is_file():
            raise _refuse(f"entry {name}: file is missing", p)
    try:
        program = Program.from_json(json.loads(prog_path.read_text()))
    except (KeyError, TypeError, ValueError) as ex:
        raise _refuse(f"entry {name}: malformed program: {ex!r}", prog_path) from None
    entry = Entry(name=name, kind=e["kind"], batch=int(e["batch"]), context=int(e["context"]),
                  tokens_per_seq=int(e["tokensPerSeq"]), body=e["body"], sha256=e["sha256"],
                  program_path=e["program"], program=program)
    if entry.kind not in ENTRY_KINDS:
        raise _refuse(f"entry {name}: unknown kind {entry.kind!r}", mpath)
    return entry


def _check_linear_state(ls: LinearState, mpath: Path) -> None:
    if ls.num_slots < 1:
        raise _refuse(f"model.linearState: numSlots {ls.num_slots} holds no sequence", mpath)
    want = {(layer, kind) for layer in ls.layers for kind in ("conv", "recurrent")}
    got = [(p.layer, p.kind) for p in ls.pools]
    if sorted(got) != sorted(want):
        raise _refuse(f"model.linearState: pools {sorted(got)} are not one conv and one "
                      f"recurrent pool for each of layers {list(ls.layers)}", mpath)
    channels = 2 * ls.num_key_heads * ls.key_head_dim + ls.num_value_heads * ls.value_head_dim
    for p in ls.pools:
        shape = ((ls.num_slots, ls.conv_kernel - 1, channels) if p.kind == "conv" else
                 (ls.num_slots, ls.num_value_heads, ls.key_head_dim, ls.value_head_dim))
        if p.shape != shape:
            raise _refuse(f"model.linearState: pool {p.name} is {list(p.shape)}, its sizes "
                          f"imply {list(shape)}", mpath)


def _check_program(entry: Entry, model: ModelShape, weights: dict[str, WeightFile],
                   pools: dict[str, KvPool], state_pools: dict[str, StatePool],
                   prog_path: Path, program_shapes: dict[str, tuple[int, ...]]) -> None:
    prog = entry.program
    for s in prog.inputs:
        if s.role not in INPUT_ROLES:
            raise _refuse(f"entry {entry.name}: input {s.name} has unknown role {s.role}", prog_path)
        if s.role == WEIGHT:
            w = weights.get(s.slot)
            if w is None:
                raise _refuse(f"entry {entry.name}: input {s.name} names weight slot {s.slot}, "
                              f"which the weight table does not have", prog_path)
            if (w.dtype, program_shapes[s.slot]) != (s.dtype, s.shape):
                raise _refuse(f"entry {entry.name}: weight slot {s.slot} is {w.dtype} "
                              f"{list(program_shapes[s.slot])} in the weight table but "
                              f"{s.dtype} {list(s.shape)} in the program", prog_path)
        if s.role == STATE_POOL_IN:
            sp = state_pools.get(s.pool)
            if sp is None or (sp.dtype, sp.shape) != (s.dtype, s.shape):
                raise _refuse(f"entry {entry.name}: input {s.name} does not match state pool "
                              f"{s.pool} of model.linearState", prog_path)
        elif s.role in POOL_IN_ROLES:
            p = pools.get(s.pool)
            want_class = "windowed" if s.role == WINDOW_KV_POOL_IN else "full"
            if p is None or (p.dtype, p.shape, p.pool_class) != (s.dtype, s.shape, want_class):
                raise _refuse(f"entry {entry.name}: input {s.name} does not match KV pool "
                              f"{s.pool} of the manifest", prog_path)
    for s in prog.outputs:
        if s.role not in OUTPUT_ROLES:
            raise _refuse(f"entry {entry.name}: output {s.name} has unknown role {s.role}", prog_path)
    _check_leading_outputs(entry, model, prog_path)
    for out_i, in_i in prog.donation:
        if not (0 <= out_i < len(prog.outputs) and 0 <= in_i < len(prog.inputs)):
            raise _refuse(f"entry {entry.name}: donation pair ({out_i}, {in_i}) is out of range",
                          prog_path)
        o, i = prog.outputs[out_i], prog.inputs[in_i]
        if (o.dtype, o.shape) != (i.dtype, i.shape):
            raise _refuse(f"entry {entry.name}: donation pair output {o.name} {o.dtype} "
                          f"{list(o.shape)} and input {i.name} {i.dtype} {list(i.shape)} differ "
                          f"in shape or dtype", prog_path)
        if (o.role, i.role) not in DONATION_ROLES or o.pool != i.pool:
            raise _refuse(f"entry {entry.name}: donation pair ({o.name}, {i.name}) does not pair "
                          f"a pool's output with the same pool's input", prog_path)
    donated_inputs = {i for _, i in prog.donation}
    for idx, s in enumerate(prog.inputs):
        if s.role in POOL_IN_ROLES and idx not in donated_inputs:
            raise _refuse(f"entry {entry.name}: pool input {s.name} has no donation pair",
                          prog_path)


def _check_leading_outputs(entry: Entry, model: ModelShape, prog_path: Path) -> None:
    """The outputs before the pools are exactly the kind's (`leading_outputs`), in order and of
    the entry's shape: a runtime reads them by role, and a verify entry without its argmaxes
    could not check a draft."""
    want = leading_outputs(entry.kind, entry.batch, entry.tokens_per_seq, model.vocab)
    outputs = entry.program.outputs
    for n, w in enumerate(want):
        found = [i for i, s in enumerate(outputs) if s.role == w.role]
        if not found:
            raise _refuse(f"entry {entry.name}: a {entry.kind} entry needs a {w.role} output "
                          f"({w.dtype} {list(w.shape)}); the program has none", prog_path)
        s = outputs[found[0]]
        if found != [n] or (s.dtype, s.shape) != (w.dtype, w.shape):
            raise _refuse(f"entry {entry.name}: a {entry.kind} entry's output {n} must be its "
                          f"only {w.role}, {w.dtype} {list(w.shape)}; the program has {s.name} "
                          f"{s.dtype} {list(s.shape)} at output {found[0]}"
                          + (f" and {len(found) - 1} more" if len(found) > 1 else ""),
                          prog_path)
    roles = {w.role for w in want}
    for s in outputs:
        if s.role not in POOL_OUT_ROLES and s.role not in roles:
            raise _refuse(f"entry {entry.name}: output {s.name} has role {s.role}, which a "
                          f"{entry.kind} entry does not return", prog_path)


def _check_body(entry: Entry, body_path: Path, devices: int) -> None:
    text = body_path.read_text()
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != entry.sha256:
        raise _refuse(f"entry {entry.name}: body sha256 {digest} differs from the manifest's "
                      f"{entry.sha256}", body_path)
    partitions = num_partitions(text)
    if partitions != devices:
        raise _refuse(f"entry {entry.name}: the body is lowered for {partitions} device(s), the "
                      f"manifest's model.tensorParallel says {devices}", body_path)
    try:
        sig = parse_main_signature(text)
    except ValueError as e:
        raise _refuse(f"entry {entry.name}: cannot read @main: {e}", body_path) from None
    prog = entry.program
    want_in = tuple(s.type_text for s in prog.inputs)
    want_out = tuple(s.type_text for s in prog.outputs)
    if sig.inputs != want_in or sig.outputs != want_out:
        raise _refuse(f"entry {entry.name}: @main signature differs from the program: "
                      f"{_first_difference(sig, want_in, want_out, prog)}", body_path)
    if sig.aliases and tuple(sorted(sig.aliases)) != tuple(sorted(prog.donation)):
        raise _refuse(f"entry {entry.name}: @main aliases {list(sig.aliases)} but the program's "
                      f"donation pairs are {list(prog.donation)}", body_path)


def _first_difference(sig: MainSignature, want_in, want_out, prog: Program) -> str:
    if len(sig.inputs) != len(want_in):
        return f"{len(sig.inputs)} parameters, the program has {len(want_in)} inputs"
    for i, (got, want) in enumerate(zip(sig.inputs, want_in)):
        if got != want:
            return f"parameter {i} ({prog.inputs[i].name}) is {got}, the program says {want}"
    if len(sig.outputs) != len(want_out):
        return f"{len(sig.outputs)} results, the program has {len(want_out)} outputs"
    for i, (got, want) in enumerate(zip(sig.outputs, want_out)):
        if got != want:
            return f"result {i} ({prog.outputs[i].name}) is {got}, the program says {want}"
    return "unknown"

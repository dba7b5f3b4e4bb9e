"""Loading a Tlaloc serving artifact: `load_artifact` reads a directory (its format is
manifest.py's) and checks everything that can be checked without compiling; every refusal is an
`ArtifactError` that names the problem and the file. Nothing here imports JAX: the repository
writer and the backend's configuration step validate artifacts without compiling them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .manifest import (DONATION_ROLES, ENTRY_KINDS, INPUT_ROLES, KNOWN_UNBUILT_SCHEMAS, LORA_POOL,
                       MANIFEST_NAME, OUTPUT_ROLES, POOL_IN_ROLES, POOL_OUT_ROLES, SCHEMA_V2,
                       SCHEMA_V3, SCHEMA_V4, STATE_POOL_IN, SUPPORTED_SCHEMAS, WEIGHT,
                       WINDOW_KV_POOL_IN, Artifact, ArtifactError, Entry, KvPool, LinearState,
                       ModelShape, Program, StatePool, WeightFile, WindowedKv, leading_outputs,
                       takes_as, tensor_bytes)
from .sharding import TensorParallel
from .stablehlo import MainSignature, num_partitions, parse_main_signature


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
    _check_packed_layout(art, mpath)
    weights = {w.slot: w for w in art.weights}
    pools = {p.name: p for p in art.pools}
    state_pools = {p.name: p for p in art.state_pools}
    _check_tensor_parallel(art.tensor_parallel, weights, {**pools, **state_pools}, mpath)
    if art.lora is not None and art.lora.devices != art.devices:
        raise _refuse(f"model.lora: adapter pools laid out for {art.lora.devices} device(s), "
                      f"the programs run on {art.devices}", mpath)
    program_shapes = {w.slot: _program_shape(art.tensor_parallel, w) for w in art.weights}
    for raw in manifest["entries"]:
        entry = _read_entry(root, mpath, raw)
        _check_program(entry, art, weights, pools, state_pools, root / entry.program_path,
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
                                   int(w["byteLength"]), w["file"], w.get("quant"))
                        for w in manifest["weights"])
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


def _check_packed_layout(art: Artifact, mpath: Path) -> None:
    """Packed weights in the layout this backend's programs were written for."""
    m = art.model
    if not m.packed:
        return
    from ..export.gguf_packed import PACKED_LAYOUT  # (imports numpy: only for packed weights)

    if m.packed_layout != PACKED_LAYOUT:
        raise _refuse(f"model.packedLayout {m.packed_layout!r} is unknown to this backend "
                      f"(known: {PACKED_LAYOUT!r})", mpath)


def _check_quant(w: WeightFile, mpath: Path) -> None:
    """A packed weight's type is one this backend's programs were written for."""
    from ..export.gguf_packed import LAYOUTS, layout_of  # (imports numpy: only for quant)

    if layout_of(w.quant) is None:
        raise _refuse(f"weight slot {w.slot}: packed type {w.quant!r} is unknown to this "
                      f"backend (known: {', '.join(LAYOUTS)}, and mixes of them named "
                      f"B<bits>_G<group>_Z<zero>[_O])", mpath)


def _check_weight_files(root: Path, mpath: Path, weights: tuple[WeightFile, ...]) -> None:
    """Each weight file exists and holds exactly dtype x shape bytes; a packed one is of a
    type this backend's programs were written for."""
    for w in weights:
        if w.quant is not None:
            _check_quant(w, mpath)
        wpath = root / w.file
        if not wpath.is_file():
            raise _refuse(f"weight slot {w.slot}: file is missing", wpath)
        expected = tensor_bytes(w.dtype, w.shape)
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


def _taken_alike(taken: dict[str, str], name: str, dtype: str, what: str, entry: Entry,
                 prog_path: Path) -> None:
    """One buffer on the device serves every entry, so all take a weight or pool alike."""
    first = taken.setdefault(name, dtype)
    if first != dtype:
        raise _refuse(f"entry {entry.name}: {what} is {dtype} in the program but {first} in an "
                      f"earlier entry's", prog_path)


def _check_program(entry: Entry, art: Artifact, weights: dict[str, WeightFile],
                   pools: dict[str, KvPool], state_pools: dict[str, StatePool],
                   prog_path: Path, program_shapes: dict[str, tuple[int, ...]]) -> None:
    """The program against the manifest; records how it takes each weight and KV pool in
    art.weight_inputs and art.pool_inputs (the first entry's way, which the others must share)."""
    prog = entry.program
    for s in prog.inputs:
        if s.role not in INPUT_ROLES:
            raise _refuse(f"entry {entry.name}: input {s.name} has unknown role {s.role}", prog_path)
        if s.role == WEIGHT:
            w = weights.get(s.slot)
            if w is None:
                raise _refuse(f"entry {entry.name}: input {s.name} names weight slot {s.slot}, "
                              f"which the weight table does not have", prog_path)
            if not takes_as(s.dtype, w.dtype) or program_shapes[s.slot] != s.shape:
                raise _refuse(f"entry {entry.name}: weight slot {s.slot} is {w.dtype} "
                              f"{list(program_shapes[s.slot])} in the weight table but "
                              f"{s.dtype} {list(s.shape)} in the program", prog_path)
            _taken_alike(art.weight_inputs, s.slot, s.dtype, f"weight slot {s.slot}", entry,
                         prog_path)
        if s.role == LORA_POOL:
            lora = art.lora
            want = lora.program_shapes().get(s.pool) if lora is not None else None
            if want is None or (s.dtype, s.shape) != ("f32", want):
                raise _refuse(f"entry {entry.name}: input {s.name} does not match adapter pool "
                              f"{s.pool} of model.lora", prog_path)
        if s.role == STATE_POOL_IN:
            sp = state_pools.get(s.pool)
            if sp is None or (sp.dtype, sp.shape) != (s.dtype, s.shape):
                raise _refuse(f"entry {entry.name}: input {s.name} does not match state pool "
                              f"{s.pool} of model.linearState", prog_path)
        elif s.role in POOL_IN_ROLES:
            p = pools.get(s.pool)
            want_class = "windowed" if s.role == WINDOW_KV_POOL_IN else "full"
            if (p is None or not takes_as(s.dtype, p.dtype)
                    or (p.shape, p.pool_class) != (s.shape, want_class)):
                raise _refuse(f"entry {entry.name}: input {s.name} does not match KV pool "
                              f"{s.pool} of the manifest", prog_path)
            _taken_alike(art.pool_inputs, s.pool, s.dtype, f"KV pool {s.pool}", entry,
                         prog_path)
    for s in prog.outputs:
        if s.role not in OUTPUT_ROLES:
            raise _refuse(f"entry {entry.name}: output {s.name} has unknown role {s.role}", prog_path)
    _check_leading_outputs(entry, art.model, prog_path)
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
    want = leading_outputs(entry.kind, entry.batch, entry.tokens_per_seq, model.vocab,
                           model.experts)
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

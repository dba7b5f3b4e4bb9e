"""The exporter: a Hugging Face checkpoint or a GGUF file in, a Tlaloc serving artifact out.

The weights are streamed: each tensor is read (a GGUF tensor dequantized), put in the
artifact's layout (decoder.weight_slots), converted to the weight dtype and written before the
next is read. The entries are lowered from ShapeDtypeStructs, so no weight is held while
lowering. The artifact is written
into a temporary directory beside OUT, validated with the same loader the backend uses, and
only then moved into place: a failed export leaves no half-written artifact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .adapters import adapter_layout
from .checkpoint import Checkpoint, expert_sources, linear_sources, open_checkpoint
from .config import DecoderConfig
from .decoder import (IN_OUT, STACKED, WeightSlot, entry_program, kv_pools, loops_layers, lower_entry,
                      state_pools, unstacked_slot, weight_slots)
from . import packing, tensor_parallel
from .gguf_packed import PACKED_LAYOUT, is_packed
from .quant import quantize_rows
from ..artifact.hf_config import HF_CONFIG_NAME, hf_config
from ..artifact.loading import load_artifact
from ..artifact.manifest import (DECODE, MANIFEST_NAME, MIXED, PACKED_QUANTS, PREFILL, SCHEMA_V2,
                                 SCHEMA_V3, SCHEMA_V4, VERIFY, Entry, LinearState, WeightFile,
                                 WindowedKv, numpy_dtype)
from ..artifact.sharding import TensorParallel
from .options import ExportError, ExportOptions


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _norm_weight(cfg: DecoderConfig, w: np.ndarray) -> np.ndarray:
    """Gemma's RMSNorm scales by (1 + weight), in f32: folded into the stored weight, so every
    family's graph scales by the weight alone."""
    if cfg.norm_offset:
        return (w.astype(np.float32) + np.float32(cfg.norm_offset)).astype(np.float32)
    return w


def slot_tensor(ckpt: Checkpoint, cfg: DecoderConfig, slot: WeightSlot) -> np.ndarray:
    """A weight slot's tensor from the checkpoint, in the artifact's layout (linears [in, out],
    or [out, in] when the slot says so; q|k|v and gate|up fused), still in the checkpoint's
    dtype."""
    name = slot.name
    t = ckpt.tensor
    if name == "embed":
        return t("model.embed_tokens.weight")
    if name == "embed_t":  # tied: stored once, [hidden, vocab]
        return t("model.embed_tokens.weight").T
    if name == "final_norm":
        return _norm_weight(cfg, t("model.norm.weight"))
    sources = linear_sources(name)
    if sources is not None:  # checkpoint linears are [out, in]; fused along out
        w = np.concatenate([t(n) for n in sources]) if len(sources) > 1 else t(sources[0])
        return w if slot.out_first else w.T
    layer, part = name.split(".", 1)
    if part in ("router", "shared_gate", "experts_gate_up", "experts_down"):  # [experts, out, in]
        experts = [np.concatenate([t(n) for n in names]) for names in expert_sources(
            cfg.family, int(layer[1:]), part, cfg.moe.num_experts)]
        return experts[0] if part in ("router", "shared_gate") else np.stack(experts)
    pre = f"model.layers.{int(layer[1:])}."
    norms = ({"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
              "mlp_norm": "pre_feedforward_layernorm",
              "post_mlp_norm": "post_feedforward_layernorm"} if cfg.sandwich_norms else
             {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
    if part in norms:
        return _norm_weight(cfg, t(pre + f"{norms[part]}.weight"))
    if part in ("q_norm", "k_norm"):
        return _norm_weight(cfg, t(pre + f"self_attn.{part}.weight"))
    lin = pre + "linear_attn."
    if part == "conv":  # the depthwise kernel [channels, 1, kernel] as [channels, kernel]
        return t(lin + "conv1d.weight")[:, 0, :]
    if part in ("A_log", "dt_bias"):
        return t(lin + part)
    if part == "lin_norm":  # the gated norm scales by its weight as stored (no 1 + weight)
        return t(lin + "norm.weight")
    raise AssertionError(f"unknown weight slot {name}")


def stored_tensor(ckpt: Checkpoint, cfg: DecoderConfig, slot: WeightSlot,
                  pieces: tuple[int, ...] | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A slot's array as the artifact stores it, before the cast to its dtype, and the slots
    written after it by name (a quantized linear's scales, a packed weight's other arrays): a
    stacked slot's layers one by one, stacked. `pieces`: a packed weight's rows banded piece by
    piece (split along its rows over devices: gguf_packed.PackedWeight.arrays)."""
    if slot.name.endswith(IN_OUT):  # a layer's [out, in] linear, transposed
        n_in, n_out = slot.shape
        base = WeightSlot(slot.name[:-len(IN_OUT)], (n_out, n_in), "linear", True)
        return stored_tensor(ckpt, cfg, base)[0].T, {}
    if slot.name.startswith(STACKED):
        layers = [unstacked_slot(slot, i) for i in range(slot.shape[0])]
        parts = [stored_tensor(ckpt, cfg, s, pieces) for s in layers]
        suffixes = [name[len(layers[0].name):] for name in parts[0][1]]
        after = {slot.name + sfx: np.stack([more[s.name + sfx] for s, (_, more) in
                                            zip(layers, parts)]) for sfx in suffixes}
        return np.stack([a for a, _ in parts]), after
    if is_packed(slot.quant):  # the GGUF file's blocks taken apart, or int4 codes (gguf_packed)
        values = lambda: np.asarray(slot_tensor(ckpt, cfg, slot), np.float32)  # noqa: E731
        if slot.kind == "experts":  # each expert packed on its own, the arrays stacked
            each = [p.arrays() for p in packing.packed_experts(ckpt, cfg, slot.name,
                                                               slot.quant, values)]
            arrays = {sfx: np.stack([a[sfx] for a in each]) for sfx in each[0]}
        else:
            arrays = packing.packed_slot(ckpt, slot.name, slot.quant, values).arrays(pieces)
        return arrays.pop(""), {slot.name + sfx: a for sfx, a in arrays.items()}
    arr = slot_tensor(ckpt, cfg, slot)
    if tuple(arr.shape) != slot.shape:
        raise ExportError(f"{ckpt.path}: weight {slot.name} has shape {list(arr.shape)}, "
                          f"the config implies {list(slot.shape)}")
    if slot.quant is not None:  # from the checkpoint's values in f32 (GGUF: dequantized)
        codes, scale = quantize_rows(arr, slot.quant)
        return codes, {f"{slot.name}.scale": scale}
    return arr, {}


def _write_weights(ckpt: Checkpoint, cfg: DecoderConfig, opts: ExportOptions, out: Path,
                   model_hash, layer_loop: bool, tp: TensorParallel | None,
                   in_out_copy: bool = False) -> list[WeightFile]:
    (out / "weights").mkdir()
    written = []
    total = 0
    t0 = time.perf_counter()
    after = {}  # a quantized linear's scales (a packed one's arrays), written after its codes
    for idx, slot in enumerate(weight_slots(cfg, opts.weight_dtype, opts.linear_quant,
                                            opts.quant_head, layer_loop, in_out_copy)):
        dtype = slot.dtype(opts.weight_dtype)
        if slot.kind == "scale":
            data = after.pop(slot.name)
        else:
            split = tensor_parallel.packed_row_split(tp, slot)
            arr, more = stored_tensor(ckpt, cfg, slot,
                                      split and split.file_pieces(tp.devices))
            after.update(more)
            if slot.quant is not None:
                data = arr
            else:  # widen first so bf16 rounding happens once, from the checkpoint's own values
                data = arr.astype(np.float32).astype(numpy_dtype(dtype))
        assert data.dtype == numpy_dtype(dtype) and data.shape == slot.shape, slot.name
        data = np.ascontiguousarray(data)
        rel = f"weights/{idx:04d}_{slot.name}.bin"
        raw = data.tobytes()  # little-endian: numpy's native order on every platform we run
        (out / rel).write_bytes(raw)
        model_hash.update(f"{slot.name}:{dtype}:{list(slot.shape)}".encode())
        model_hash.update(hashlib.sha256(raw).digest())
        written.append(WeightFile(slot.name, dtype, slot.shape, len(raw), rel,
                                  slot.quant if is_packed(slot.quant) else None))
        total += len(raw)
    if opts.weight_quant is not None:
        model_hash.update(f":q{opts.weight_quant}".encode())  # the hash records the quantization
        if opts.quant_head:
            model_hash.update(b":head")
    assert not after, list(after)
    _log(f"[export] {len(written)} weight files, {total / 2**20:.1f} MiB, "
         f"{time.perf_counter() - t0:.1f} s")
    return written


def export_artifact(checkpoint: str | Path, out: str | Path, opts: ExportOptions = ExportOptions(),
                    ) -> Path:
    """Write a Tlaloc serving artifact for `checkpoint` at `out`; returns `out`. The schema is
    v2, v3 with a windowed pool, v4 with linear-attention state pools."""
    opts.validate()
    ckpt = open_checkpoint(checkpoint, opts.model_name)
    cfg = ckpt.config
    num_blocks = opts.resolved_num_blocks()
    _check_model(ckpt, num_blocks)
    _check_experts(cfg, opts)
    lora = adapter_layout(cfg, opts)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        t0 = time.perf_counter()
        _log(f"[export] {cfg.model_name}: {cfg.family}, {cfg.num_layers} layers, hidden "
             f"{cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of "
             f"{cfg.head_size}, vocab {cfg.vocab_size}, weights {opts.weight_dtype}"
             + (f", linears {opts.weight_quant}" if opts.weight_quant else "")
             + f", KV {opts.kv_type}"
             + (f"; experts: {cfg.moe.num_experts}, top {cfg.moe.top_k}, on "
                f"{len(cfg.moe.layers)} of the layers" if cfg.moe else ""))
        model_hash = hashlib.sha256(json.dumps(cfg.to_json(), sort_keys=True).encode())
        windowed = opts.windowed(cfg, num_blocks)
        # alike layers run as one loop (docs/design.md#the-layer-loop) unless told otherwise
        layer_loop = opts.layer_loop and loops_layers(cfg, windowed)
        if opts.weight_quant in PACKED_QUANTS:  # each packed slot's type, before any write
            opts = dataclasses.replace(opts, slot_quants=packing.slot_quants(ckpt, cfg, opts,
                                                                             layer_loop))
        # Before the weights: heads that do not divide are refused before any is converted.
        tp = _tensor_parallel(cfg, opts, num_blocks, windowed, layer_loop)
        # the loop's f32 linears copied [in, out] for products of many rows (in_out_copies)
        in_out_copy = (opts.in_out_copy and layer_loop and opts.weight_dtype == "f32"
                       and tp is None)
        weights = _write_weights(ckpt, cfg, opts, tmp, model_hash, layer_loop, tp, in_out_copy)
        tokenizer_files = ckpt.save_tokenizer(tmp / "tokenizer")
        _log(f"[export] tokenizer: {', '.join(tokenizer_files) or 'none in the checkpoint'}")
        _log("[export] layers: " + ("one loop over stacked weights and pools" if layer_loop
                                    else "unrolled, one set of kernels per layer"))

        linear_state = _linear_state(_program_config(cfg, tp), opts)
        verify_tokens = _verify_tokens(cfg, opts, windowed)
        opts = dataclasses.replace(opts, mixed_tokens=_mixed_tokens(opts))
        entries = _write_entries(cfg, opts, num_blocks, windowed, tmp, layer_loop, verify_tokens,
                                 tp, lora, in_out_copy)
        _log_pools(cfg, windowed, linear_state)
        if lora is not None:
            _log(f"[export] adapters: rank up to {lora.max_rank}, {lora.slots - 1} slots of "
                 f"{lora.slot_bytes / 2**20:.1f} MiB")
        manifest = _manifest(cfg, opts, num_blocks, model_hash.hexdigest(), windowed,
                             linear_state, entries, weights, layer_loop, verify_tokens, tp)
        if lora is not None:
            manifest["model"]["lora"] = lora.to_json()
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
        _write_hf_config(tmp, manifest)
        load_artifact(tmp)  # every body against its signature, every file against the manifest
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        _log(f"[export] wrote {out} ({len(entries)} entries) in {time.perf_counter() - t0:.1f} s")
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_hf_config(out: Path, manifest: dict) -> None:
    """config.json (artifact/hf_config.py) and the checkpoint's generation_config.json at the
    artifact's root, where a tool that loads a model folder (vLLM) looks for them."""
    (out / HF_CONFIG_NAME).write_text(json.dumps(hf_config(manifest), indent=1) + "\n")
    generation = out / "tokenizer" / "generation_config.json"
    if generation.is_file():
        shutil.copyfile(generation, out / "generation_config.json")


def _tensor_parallel(cfg: DecoderConfig, opts: ExportOptions, num_blocks: int,
                     windowed: WindowedKv | None, layer_loop: bool) -> TensorParallel | None:
    """The splits over opts.tensor_parallel devices (None for one device); a model whose heads
    do not divide is refused by name."""
    n = opts.tensor_parallel
    if n == 1:
        return None
    try:
        program_cfg = tensor_parallel.logical_config(cfg, n)
        tp = tensor_parallel.plan(
            cfg, n, weight_slots(cfg, opts.weight_dtype, opts.linear_quant, opts.quant_head,
                                 layer_loop),
            kv_pools(program_cfg, num_blocks, opts.block_size, opts.kv_type, windowed,
                     layer_loop),
            state_pools(program_cfg, opts.resolved_state_slots()),
            split_vocab=not opts.replicate_vocab)
    except tensor_parallel.TensorParallelError as e:
        raise ExportError(f"--tensor-parallel {n}: {e}") from None
    copies = (f"; each of the {cfg.num_kv_heads} KV heads held by {tp.kv_head_copies} devices"
              if tp.kv_head_copies > 1 else "")
    vocab = ("split by vocabulary" if "embed" in tp.weights or "embed_t" in tp.weights else
             "copied whole" + ("" if opts.replicate_vocab else
                               f" (a vocabulary of {cfg.vocab_size} does not divide)"))
    _log(f"[export] tensor parallel over {n} devices: {len(tp.weights)} weights and "
         f"{len(tp.pools)} pools split, the rest replicated; embedding and head {vocab}{copies}")
    return tp


def _check_experts(cfg: DecoderConfig, opts: ExportOptions) -> None:
    """Refuses, by name, what a mixture of experts cannot have yet: an AWQ or GPTQ
    checkpoint's packed experts."""
    if cfg.moe is None:
        return
    if opts.weight_quant in ("awq", "gptq"):
        raise ExportError(f"--weight-quant {opts.weight_quant}: a mixture of experts' "
                          f"{opts.weight_quant.upper()} weights are not read packed yet "
                          f"(--weight-quant int4 quantizes a full-precision checkpoint's "
                          f"experts)")


def _check_model(ckpt: Checkpoint, num_blocks: int) -> None:
    """Refuses, before anything is written, heads that do not group over the KV heads and a
    pool without room for page 0 and one page more."""
    cfg = ckpt.config
    if cfg.num_heads % cfg.num_kv_heads:
        raise ExportError(f"{ckpt.path}: {cfg.num_heads} heads are not a multiple of "
                          f"{cfg.num_kv_heads} KV heads")
    if num_blocks < 2:
        raise ExportError(f"--num-blocks {num_blocks}: need page 0 and at least one more")


def _verify_tokens(cfg: DecoderConfig, opts: ExportOptions,
                   windowed: WindowedKv | None) -> tuple[int, ...]:
    """The verify entries' tokensPerSeq this model gets: none for a linear-attention model, and
    with a windowed pool only those a ring holds past the window; each refusal logged."""
    wanted = tuple(sorted(t for t in set(opts.verify_tokens) if t <= max(opts.context_ladder)))
    if not wanted:
        return ()
    if cfg.linear is not None:
        # A rejected draft token would stay folded into the conv and recurrent states: they
        # cannot be rewound to the accepted position as a KV page's length can.
        _log("[export] verify entries: none (speculative decoding is refused for a model with "
             "linear-attention layers: their state cannot be rewound past a rejected draft)")
        return ()
    keep = wanted
    if windowed is not None:
        # A call of t tokens from position p0 needs min(p0, window - 1) + t positions of the
        # ring at once, as a prefill chunk does (docs/design.md#the-windowed-pool).
        room = windowed.ring_pages * opts.block_size - (windowed.window - 1)
        keep = tuple(t for t in wanted if t <= room)
        if keep != wanted:
            _log(f"[export] verify entries: tokens {[t for t in wanted if t > room]} left out: a "
                 f"ring of {windowed.ring_pages} pages holds {room} tokens past the window")
    _log(f"[export] verify entries: tokens {list(keep)} at every batch")
    return keep


def _mixed_tokens(opts: ExportOptions) -> tuple[int, ...]:
    """The mixed entries' tokensPerSeq: none (logged, with why) for a program over several
    devices, whose calls do not share one row of tokens yet."""
    wanted = tuple(sorted(t for t in set(opts.mixed_tokens) if t <= max(opts.context_ladder)))
    if not wanted:
        return ()
    if opts.tensor_parallel > 1:
        _log("[export] mixed entries: none (not written for tensor parallelism: its prompts "
             "and decode rows run in separate calls)")
        return ()
    _log(f"[export] mixed entries: chunks of {list(wanted)} tokens beside decode rows of "
         f"batches {mixed_batches(opts)}")
    return wanted


def _log_pools(cfg: DecoderConfig, windowed: WindowedKv | None,
               linear_state: LinearState | None) -> None:
    if linear_state is not None:
        _log(f"[export] linear-attention state: {len(linear_state.layers)} of "
             f"{cfg.num_layers} layers, {linear_state.num_slots} slots of "
             f"{linear_state.bytes_per_slot / 2**10:.1f} KiB (any context)")
    if windowed is not None:
        _log(f"[export] windowed KV pool: window {windowed.window}, {len(windowed.layers)} of "
             f"{cfg.num_layers} layers, rings of {windowed.ring_pages} pages, "
             f"{windowed.num_blocks} pages per pool")


def _manifest(cfg: DecoderConfig, opts: ExportOptions, num_blocks: int, model_hash: str,
              windowed: WindowedKv | None, linear_state: LinearState | None,
              entries: list[Entry], weights: list[WeightFile], layer_loop: bool,
              verify_tokens: tuple[int, ...] = (), tp: TensorParallel | None = None) -> dict:
    """The artifact's manifest, as manifest.json holds it (its keys in this order)."""
    pools = kv_pools(_program_config(cfg, tp), num_blocks, opts.block_size, opts.kv_type,
                     windowed, layer_loop)
    model = _model_json(cfg, opts, num_blocks, model_hash, windowed, linear_state, layer_loop,
                        verify_tokens)
    if tp is not None:
        model["tensorParallel"] = tp.to_json()
    return {
        "schema": (SCHEMA_V4 if linear_state is not None else
                   SCHEMA_V3 if windowed is not None else SCHEMA_V2),
        "exporter": "triton-tlaloc",
        "model": model,
        "buckets": {"batchLadder": sorted(opts.batch_ladder),
                    "contextLadder": sorted(opts.context_ladder)},
        "kvPool": {"numBlocks": num_blocks, "blockSize": opts.block_size,
                   "pools": [p.to_json() for p in pools]},
        "entries": [e.to_json() for e in entries],
        "weights": [w.to_json() for w in weights],
        # every pool is donated: docs/design.md#donation
        "donation": [{"output": f"{p.name}.out", "input": f"{p.name}.in"}
                     for p in (*pools, *(linear_state.pools if linear_state else ()))],
    }


def _model_json(cfg: DecoderConfig, opts: ExportOptions, num_blocks: int, model_hash: str,
                windowed: WindowedKv | None, linear_state: LinearState | None,
                layer_loop: bool, verify_tokens: tuple[int, ...] = ()) -> dict:
    """The manifest's "model": the model's shape and the export's choices."""
    return {
        "family": cfg.family,
        "modelName": cfg.model_name,
        "modelHash": f"sha256:{model_hash}",
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "kvHeads": cfg.num_kv_heads,
        "headSize": cfg.head_size,
        "hiddenSize": cfg.hidden_size,
        "intermediateSize": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "blockSize": opts.block_size,
        "numBlocks": num_blocks,
        "weightDtype": opts.weight_dtype,
        "weightQuant": opts.weight_quant,
        "headQuant": opts.quant_head,
        **({"packedLayout": PACKED_LAYOUT} if opts.weight_quant in PACKED_QUANTS else {}),
        "kvDtype": opts.kv_type,
        "maxPositions": cfg.max_positions,
        "prefillChunk": opts.prefill_chunk,
        "verifyTokens": list(verify_tokens),
        "mixedTokens": list(opts.mixed_tokens),
        "attentionBlock": list(opts.key_blocks(PREFILL)),
        "decodeAttentionBlock": list(opts.key_blocks(DECODE)),
        "manyRowsAttentionBlock": opts.resolved_many_rows_block(),
        "layerLoop": layer_loop,
        "layerWindows": [cfg.window(i) for i in range(cfg.num_layers)],
        **({"windowedKv": windowed.to_json()} if windowed is not None else {}),
        **({"linearState": linear_state.to_json()} if linear_state is not None else {}),
        **({"rotaryDim": cfg.rotary_dim} if cfg.rotary_dim else {}),
        **({"experts": cfg.moe.to_json()} if cfg.moe is not None else {}),
        "ropeTheta": cfg.rope_theta,
        "rmsNormEps": cfg.rms_norm_eps,
        "tieWordEmbeddings": cfg.tie_word_embeddings,
        "refusedTokens": [{"id": i, "configKey": k} for k, i in cfg.refused_tokens],
        "eosTokenIds": list(cfg.eos_token_ids),
        "bosTokenId": cfg.bos_token_id,
    }


def _program_config(cfg: DecoderConfig, tp: TensorParallel | None) -> DecoderConfig:
    """The model the programs compute: with tensor parallelism, each KV head repeated for the
    devices that share it (tensor_parallel.logical_config)."""
    return cfg if tp is None else tensor_parallel.logical_config(cfg, tp.devices)


def _linear_state(cfg: DecoderConfig, opts: ExportOptions) -> LinearState | None:
    la = cfg.linear
    if la is None:
        return None
    slots = opts.resolved_state_slots()
    return LinearState(la.layers, slots, la.conv_kernel, la.num_key_heads, la.num_value_heads,
                       la.key_head_dim, la.value_head_dim, tuple(state_pools(cfg, slots)))


def _entry_plan(opts: ExportOptions, verify_tokens: tuple[int, ...]) -> list[tuple]:
    """(kind, batch, context, tokensPerSeq) of every entry, in the manifest's order: for each
    context, the decode entries by batch, the prefill entries by batch and tokens, then the
    verify entries and the mixed entries by batch and tokens."""
    plan = []
    for c in sorted(opts.context_ladder):
        for b in sorted(opts.batch_ladder):
            plan.append((DECODE, b, c, 1))
        for b in sorted(opts.batch_ladder):
            if opts.prefill_max_batch is None or b <= opts.prefill_max_batch:
                plan += [(PREFILL, b, c, t) for t in opts.prefill_token_ladder(c)]
        for b in sorted(opts.batch_ladder):
            plan += [(VERIFY, b, c, t) for t in sorted(verify_tokens) if t <= c]
        for b in mixed_batches(opts):
            plan += [(MIXED, b, c, t) for t in sorted(opts.mixed_tokens) if t <= c]
    return plan


def mixed_batches(opts: ExportOptions) -> list[int]:
    """The mixed entries' batches: `mixed_batches` (None: the ladder's), none above the
    ladder's largest (a batch of more decode rows than a step has is padding)."""
    top = max(opts.batch_ladder)
    return sorted({min(b, top) for b in (opts.mixed_batches or opts.batch_ladder)})


def entry_name(opts: ExportOptions, kind: str, batch: int, context: int, tokens: int) -> str:
    """decode_b{B}_c{C}; prefill_b{B}_c{C}, with _t{T} below the largest of its (batch,
    context); verify_b{B}_c{C}_t{T} and mixed_b{B}_c{C}_t{T} always (a context has several,
    none the plain one)."""
    plain = kind == DECODE or (kind == PREFILL and tokens == opts.tokens_per_seq(context))
    return f"{kind}_b{batch}_c{context}" if plain else f"{kind}_b{batch}_c{context}_t{tokens}"


def _write_entries(cfg: DecoderConfig, opts: ExportOptions, num_blocks: int,
                   windowed: WindowedKv | None, out: Path, layer_loop: bool,
                   verify_tokens: tuple[int, ...] = (),
                   tp: TensorParallel | None = None, lora=None,
                   in_out_copy: bool = False) -> list[Entry]:
    (out / "bodies").mkdir()
    (out / "programs").mkdir()
    plan = _entry_plan(opts, verify_tokens)
    file_cfg, cfg = cfg, _program_config(cfg, tp)
    entries = []
    for n, (kind, b, c, tps) in enumerate(plan, 1):
        t0 = time.perf_counter()
        name = entry_name(opts, kind, b, c, tps)
        slots = opts.resolved_state_slots() if file_cfg.linear is not None else 0
        program = entry_program(cfg, name, b, c, tps, opts.block_size, num_blocks,
                                opts.weight_dtype, opts.kv_type, windowed, slots,
                                opts.linear_quant, opts.quant_head, layer_loop, kind, lora,
                                in_out_copy)
        text = lower_entry(cfg, program, opts.block_size, num_blocks, opts.weight_dtype,
                           opts.key_blocks(kind, b), windowed, slots, opts.linear_quant,
                           opts.quant_head, layer_loop, kind, tp, lora, in_out_copy)
        calls = sorted(set(re.findall(r"custom_call @([\w.]+)", text)))
        if calls:
            # A custom call is a platform's library function (jax's triangular solve lowers to
            # LAPACK on CPU): the artifact would not serve elsewhere, and a process that never
            # lowered anything may not have it initialized.
            raise ExportError(f"entry {name}: the lowered program calls custom call(s) "
                              f"{', '.join(calls)}; an artifact must be plain StableHLO")
        sha = hashlib.sha256(text.encode()).hexdigest()
        body = f"bodies/{sha}.mlir"
        (out / body).write_text(text)
        prog_rel = f"programs/{name}.json"
        (out / prog_rel).write_text(json.dumps(program.to_json(), indent=1) + "\n")
        entries.append(Entry(name, kind, b, c, tps, body, sha, prog_rel, program))
        _log(f"[export] entry {n}/{len(plan)} {name}: {len(text) / 1024:.0f} KiB of StableHLO, "
             f"{time.perf_counter() - t0:.1f} s")
    return entries

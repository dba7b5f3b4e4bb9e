#!/usr/bin/env python3
"""What LoRA adapters cost a decode step, side by side in one run: SmolLM2-135M (f32, from its
GGUF, every layer's q/k/v/o and gate/up/down adapted) exported without adapters, with adapter
pools (rank --rank, 4 slots), and with the same pools read by the two other formulations (each
row's A and B indexed where they lie, row by row; the call's tokens grouped by slot, a grouped
product per part, where the default gathers each row's A and B). Each target runs
a 4-row decode call after 64-token prompts: the plain artifact; the adapter artifacts with four
different adapters (random A and B in PEFT's files, written here with numpy) and with no
adapter (slot 0). Also the time to write one adapter into a slot.

Method: the targets take turns for --rounds rounds (the first a warm-up, not counted); a step
figure is the median of 10 decode calls after 2 untimed ones, then the median over the counted
rounds; prompts are random ids, unique per round. Run it on an otherwise idle machine:

    .venv/bin/python scripts/lora_bench.py [--rank 16] [--rounds 4]

Prints each target's ms per call and its ratio to the plain artifact's
(docs/performance.md#lora-adapters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192),
           "self_attn.v_proj": (576, 192), "self_attn.o_proj": (576, 576),
           "mlp.gate_proj": (576, 1536), "mlp.up_proj": (576, 1536),
           "mlp.down_proj": (1536, 576)}  # SmolLM2-135M: (in, out)


def write_adapter(path: Path, rank: int, seed: int, layers: int = 30) -> Path:
    """A random PEFT LoRA adapter of SmolLM2 on every linear of every layer."""
    from safetensors.numpy import save_file

    if (path / "adapter_config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(layers):
        for module, (n_in, n_out) in MODULES.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * 0.02
                                               ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02
                                               ).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": [m.split(".")[1] for m in MODULES]}))
    return path


def indexed_update(x, a_pool, b_pool, layer, slots, outs, devices=1):
    """The other formulation (export/lora_graph.py's docstring): each row's A and B sliced
    where they lie in the pools, row by row, and multiplied as matrix-vector products."""
    import jax.numpy as jnp
    from jax import lax

    rank, rows = b_pool.shape[-1], []
    for r in range(x.shape[0]):
        a = lax.dynamic_slice(a_pool, (layer, slots[r], 0, 0), (1, 1, *a_pool.shape[2:]))[0, 0]
        b = lax.dynamic_slice(b_pool, (layer, slots[r], 0, 0), (1, 1, *b_pool.shape[2:]))[0, 0]
        h = jnp.einsum("ti,wi->tw", x[r], a, precision=lax.Precision.HIGHEST)
        parts, row = [], 0
        for j, n in enumerate(outs):
            parts.append(jnp.einsum("tr,or->to", h[:, j * rank:(j + 1) * rank],
                                    b[row:row + n], precision=lax.Precision.HIGHEST))
            row += n
        rows.append(jnp.concatenate(parts, axis=-1))
    return jnp.stack(rows)


def grouped_update(x, a_pool, b_pool, layer, slots, outs, devices=1):
    """The grouped formulation (Punica's SGMV, S-LoRA): the call's tokens sorted by slot and
    each slot's A and B applied to its own group of rows, one grouped product
    (`jax.lax.ragged_dot`) for A and one a module for B, then the rows put back in order."""
    import jax.numpy as jnp
    from jax import lax

    b, t, n_in = x.shape
    rank, n_slots = b_pool.shape[-1], a_pool.shape[1]
    token_slots = jnp.repeat(slots, t)
    order = jnp.argsort(token_slots, stable=True)
    sizes = jnp.bincount(token_slots, length=n_slots).astype(jnp.int32)
    rows = x.reshape(b * t, n_in)[order]
    a = jnp.swapaxes(a_pool[layer], 1, 2)  # [slots, in, rank x modules]
    h = lax.ragged_dot(rows, a, sizes, precision=lax.Precision.HIGHEST)
    parts, row = [], 0
    for j, n in enumerate(outs):
        bj = jnp.swapaxes(b_pool[layer][:, row:row + n], 1, 2)  # [slots, rank, n]
        parts.append(lax.ragged_dot(h[:, j * rank:(j + 1) * rank], bj, sizes,
                                    precision=lax.Precision.HIGHEST))
        row += n
    out = jnp.concatenate(parts, axis=-1)
    return out[jnp.argsort(order)].reshape(b, t, -1)


def artifacts(out: Path, rank: int) -> dict[str, Path]:
    from triton_tlaloc.export import ExportOptions, export_artifact, layers
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    base = dict(batch_ladder=(4,), context_ladder=(128,), prefill_chunk=64, num_blocks=40)
    update = layers.lora_update
    arts = {}
    other = {"adapters, indexed": indexed_update, "adapters, grouped": grouped_update}
    for name in ("plain", "adapters", *other):
        opts = dict(max_lora_rank=rank, lora_slots=4) if name != "plain" else {}
        path = out / f"smollm2-{name.replace(', ', '-')}-r{rank}"
        if not path.exists():
            if name in other:
                layers.lora_update = other[name]
            try:
                export_artifact(smollm2_gguf_path(), path, ExportOptions(**base, **opts))
            finally:
                layers.lora_update = update
        arts[name] = path
    return arts


def decode_ms(engine, prompts: list[list[int]], slots: list[int]) -> float:
    from triton_tlaloc.kv.sequence import Sequence

    seqs = []
    for prompt, slot in zip(prompts, slots):
        seq = Sequence([])
        seq.adapter_slot = slot
        engine.admit(seq, prompt)
        seq.token_ids.append(int(np.argmax(engine.prefill_chunked(seq)[0])))
        seqs.append(seq)
    steps = []
    for _ in range(12):
        t0 = time.perf_counter()
        logits = engine.decode(seqs)
        steps.append(time.perf_counter() - t0)
        for seq, row in zip(seqs, logits):
            seq.token_ids.append(int(np.argmax(row)))
    for seq in seqs:
        engine.free(seq)
    return statistics.median(steps[2:]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "lora-bench"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arts = artifacts(out, a.rank)
    adapters = [write_adapter(out / f"adapter-r{a.rank}-{k}", a.rank, k) for k in range(4)]

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.lora.peft_adapter import read_peft_adapter
    from triton_tlaloc.runtime.core import Runtime

    engines, writes = {}, []
    for name, path in arts.items():
        rt = Runtime(path)
        if rt.adapters is not None:
            for slot, adapter in enumerate(adapters, 1):
                arrays = read_peft_adapter(adapter, rt.artifact.lora).arrays
                rt.adapters.write(slot, arrays)  # (the first compiles the write program)
                writes.append(rt.adapters.write(slot, arrays) * 1e3)
        engines[name] = Engine(rt)
    targets = [("plain", "plain", [0] * 4), ("adapters, 4 different", "adapters", [1, 2, 3, 4]),
               ("adapters, none (slot 0)", "adapters", [0] * 4),
               ("adapters indexed row by row, 4 different", "adapters, indexed", [1, 2, 3, 4]),
               ("adapters grouped by slot (ragged_dot), 4 different", "adapters, grouped",
                [1, 2, 3, 4])]
    times = {t[0]: [] for t in targets}
    rng = np.random.default_rng(0)
    for r in range(a.rounds):
        for label, name, slots in targets:
            prompts = [[int(t) for t in rng.integers(100, 40000, 64)] for _ in range(4)]
            ms = decode_ms(engines[name], prompts, slots)
            if r:
                times[label].append(ms)
            print(f"round {r}: {label}: {ms:.2f} ms", flush=True)
    plain = statistics.median(times["plain"])
    print(f"\nSmolLM2-135M f32, a 4-row decode call (context 128), rank {a.rank} on q/k/v/o and "
          f"gate/up/down of every layer; medians of {a.rounds - 1} rounds\n")
    print("| target | ms a call | / plain |")
    print("|---|---:|---:|")
    for label, _, _ in targets:
        ms = statistics.median(times[label])
        print(f"| {label} | {ms:.2f} | {ms / plain:.2f}x |")
    adapter_mib = read_peft_adapter(adapters[0], engines["adapters"].rt.artifact.lora).nbytes
    print(f"\nan adapter written into a slot: median {statistics.median(writes):.1f} ms "
          f"({adapter_mib / 2**20:.1f} MiB; {len(writes)} writes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

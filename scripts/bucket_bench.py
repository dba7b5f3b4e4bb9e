#!/usr/bin/env python3
"""What a context bucket costs a sequence that does not fill it: SmolLM2-135M f32 exported at
one context bucket each (512, 2,048 and 8,192 by default), the same 440-token prompt and 32
decode steps through each, one process, every artifact taken in turn within every round. Two
exports of each bucket, nothing else different: attention that follows the sequence (the
exporter's key blocks: a call loops over the blocks its rows hold) and the whole bucket (the
export before it: decode scores every page of the bucket in one pass, prefill attends key
blocks of 2,048). Then sequences really grown to 2,000 and 8,000 positions in the largest
bucket, both ways, against the floor of reading their live KV plus the weights once a step at
the bandwidth this process measures (a jitted product of a 256 MiB matrix and a vector on the
same PJRT client).

Method: every runtime compiles and runs the prompt once before timing; each round uses a new
seeded random prompt (no KV is reused: the engine's prefix reuse is off); the figures are the
medians over --runs rounds, decode as the median step of each run. Nothing else should run on
the machine.

    .venv/bin/python scripts/bucket_bench.py [--runs 5] [--decode-block 256,1024]
        [--attention-block 256] [--work artifacts/bucket-bench] [--keep]
    (--decode-block 256,1024: blocks of 256, or of 1,024 once a call holds more than 2,048)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.engine.core import Engine  # noqa: E402
from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.runtime.core import Runtime  # noqa: E402

PREFILL_CHUNK = 512  # every bucket prefills the prompt with the same 512-token entry
FOLLOWS, WHOLE = "follows the sequence", "whole bucket"


def export(work: Path, bucket: int, variant: str, args) -> Path:
    """One bucket's artifact (reused with --keep when its options are unchanged)."""
    opts = dict(batch_ladder=(1,), context_ladder=(bucket,), prefill_chunk=PREFILL_CHUNK,
                verify_tokens=(), num_blocks=bucket // 16 + 2)
    if variant == WHOLE:
        opts.update(attention_block=2048, decode_attention_block=bucket)
    else:
        for flag, name in ((args.attention_block, "attention_block"),
                           (args.decode_block, "decode_attention_block")):
            if flag is not None:
                opts[name] = flag
    options = ExportOptions(**opts)
    # the key blocks as resolved (a changed default is a changed artifact)
    opts.update(attention_block=options.attention_block,
                decode_attention_block=options.decode_attention_block)
    out = work / f"smollm2-{bucket}-{'whole' if variant == WHOLE else 'follows'}"
    stamp = out / "bench-options.json"
    opts = json.loads(json.dumps(opts))  # as the stamp holds them (lists)
    if not (args.keep and stamp.exists() and json.loads(stamp.read_text()) == opts):
        export_artifact(smollm2_gguf_path(), out, options)
        stamp.write_text(json.dumps(opts))
    return out


def bandwidth_gbps() -> float:
    """Bytes a second a jitted matrix-vector product streams from memory on this PJRT CPU
    client: a decode step's access pattern (a plain reduction runs on fewer threads and reads
    at under half the rate)."""
    import jax
    import numpy as np

    matrix = jax.device_put(np.ones((16384, 4096), np.float32))  # 256 MiB
    vector = jax.device_put(np.ones((4096,), np.float32))
    product = jax.jit(lambda m, v: m @ v)
    product(matrix, vector).block_until_ready()
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        product(matrix, vector).block_until_ready()
        times.append(time.perf_counter() - t0)
    return matrix.nbytes / statistics.median(times) / 1e9


def timed(engine: Engine, rng: random.Random, n: int, steps: int) -> tuple[float, float]:
    """(prompt ms, median decode ms a step) for a new n-token prompt and `steps` steps."""
    prompt = [rng.randrange(10, 49_000) for _ in range(n)]
    r = engine.generate_greedy(prompt, steps + 1)
    return r.prefill_ms, r.median_ms_per_token


def key_blocks(engine: Engine) -> str:
    """The prefill and the decode key blocks, "/" between a call's choices."""
    model = engine.art.manifest["model"]
    return ", ".join("/".join(map(str, model[k])) for k in ("attentionBlock",
                                                             "decodeAttentionBlock"))


def bucket_table(engines: dict, args, rng: random.Random) -> dict:
    """The prompt and the decode steps through every artifact in turn, --runs rounds."""
    times = {key: ([], []) for key in engines}
    for _ in range(args.runs):
        for key, engine in engines.items():
            p, d = timed(engine, rng, args.prompt, args.steps)
            times[key][0].append(p)
            times[key][1].append(d)
    med = {key: (statistics.median(p), statistics.median(d)) for key, (p, d) in times.items()}
    smallest = min(b for b, _ in engines)
    print(f"SmolLM2-135M f32, batch 1, a {args.prompt}-token prompt and {args.steps} decode "
          f"steps, medians of {args.runs} runs; ratios against the {smallest} bucket of the "
          f"same export\n")
    print("| attention | bucket | key blocks (prefill, decode) | prompt ms | x | "
          "decode ms/token | x |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (bucket, variant), (p, d) in med.items():
        p0, d0 = med[smallest, variant]
        print(f"| {variant} | {bucket} | {key_blocks(engines[bucket, variant])} | {p:.0f} | "
              f"{p / p0:.2f} | {d:.2f} | {d / d0:.2f} |")
    return {f"{b} {v}": {"prompt_ms": t[0], "decode_ms": t[1]} for (b, v), t in times.items()}


def grown_table(engines: dict, grown: list[int], args, rng: random.Random) -> list[dict]:
    """Sequences grown to each length in the largest bucket, both exports in turn."""
    largest = max(b for b, _ in engines)
    pair = {v: engines[largest, v] for v in (FOLLOWS, WHOLE) if (largest, v) in engines}
    rt = next(iter(pair.values())).rt
    gbps = bandwidth_gbps()
    per_position = rt.kv_pool_bytes / (rt.artifact.model.num_blocks * rt.artifact.model.block_size)
    for engine in pair.values():
        timed(engine, rng, min(grown), 2)  # every prefill length warm
    rows = []
    for n in grown:
        runs = {v: [] for v in pair}
        for _ in range(max(1, args.runs // 2)):
            for v, engine in pair.items():
                runs[v].append(timed(engine, rng, n, args.steps))
        read = rt.weight_bytes + per_position * (n + args.steps // 2)
        floor_ms = read / (gbps * 1e9) * 1e3
        for v, r in runs.items():
            rows.append(dict(positions=n, attention=v, floor_ms=floor_ms, bytes=read,
                             prompt_ms=statistics.median(x[0] for x in r),
                             decode_ms=statistics.median(x[1] for x in r)))
    print(f"\nGrown in bucket {largest}: the n-token prompt, then decode ms/token against the "
          f"floor of reading the weights and the live KV once a step at {gbps:.1f} GB/s "
          f"(measured here), medians of {max(1, args.runs // 2)} runs\n")
    print("| positions | attention | prompt s | decode ms/token | bytes a step (MiB) | floor ms "
          "| x floor |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['positions']} | {r['attention']} | {r['prompt_ms'] / 1e3:.1f} | "
              f"{r['decode_ms']:.2f} | {r['bytes'] / 2**20:.0f} | {r['floor_ms']:.2f} | "
              f"{r['decode_ms'] / r['floor_ms']:.2f} |")
    return rows


def blocks(text: str) -> tuple[int, ...]:
    return tuple(int(b) for b in text.split(","))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bucket-bench")
    ap.add_argument("--buckets", default="512,2048,8192")
    ap.add_argument("--prompt", type=int, default=440)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--grown", default="2000,8000",
                    help="sequence lengths grown in the largest bucket ('' for none)")
    ap.add_argument("--attention-block", type=blocks, default=None,
                    help="prefill key block(s), comma-separated (the exporter's default when "
                         "not given)")
    ap.add_argument("--decode-block", type=blocks, default=None,
                    help="decode key block(s), comma-separated (the exporter's default when "
                         "not given)")
    ap.add_argument("--no-whole", action="store_true",
                    help="only the exporter's key blocks (a sweep), not the whole-bucket export")
    ap.add_argument("--keep", action="store_true",
                    help="reuse artifacts exported earlier with the same options")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    grown = [int(n) for n in args.grown.split(",") if n.strip()]
    rng = random.Random(0)

    engines = {}
    for variant in (FOLLOWS,) if args.no_whole else (FOLLOWS, WHOLE):
        for bucket in buckets:
            art = load_artifact(export(args.work, bucket, variant, args))
            engine = Engine(Runtime(art, entries=sorted(art.entries)))
            timed(engine, rng, args.prompt, 2)  # compiles and warms every entry used
            engines[bucket, variant] = engine
    figures = {"buckets": bucket_table(engines, args, rng)}
    if grown:
        figures["grown"] = grown_table(engines, grown, args, rng)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

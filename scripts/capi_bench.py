#!/usr/bin/env python3
"""The C API runtime against the JAX runtime, side by side in one run: `tlaloc run` of one
artifact (default: SmolLM2-135M f32 from its GGUF, batch 1, context 512) in a fresh process
per run, the two runtimes taking turns for --rounds rounds (the first a warm-up that fills
each runtime's compile cache, not counted). Each run generates 32 tokens after a 64-token
prompt of unique random ids, after one untimed warm-up generation in the same process. Reported
per runtime, medians over the counted rounds: decode ms per token (the median step), prefill
ms, the process's wall time from start to its answer (load, compile-cache reads, the two
generations) and its peak resident memory (the kernel's maxrss, by GNU time); and whether
JAX was imported (the capi runs are made under an import guard that raises on jax, jaxlib
and torch, so they fail if it is).

    .venv/bin/python scripts/capi_bench.py [--artifact DIR] [--rounds 4]

Run it on an otherwise idle machine (docs/performance.md#the-c-api-runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def smollm2(out: Path) -> Path:
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    if not (out / "tlaloc-serving.json").exists():
        export_artifact(smollm2_gguf_path(), out, ExportOptions(batch_ladder=(1,),
                                                                context_ladder=(512,)))
    return out


def one_run(art: Path, runtime: str, prompt: list[int], cache: Path) -> dict:
    cmd = [sys.executable, "-m", "checks.import_guard", "jax,jaxlib,torch"] if runtime == "capi" \
        else [sys.executable, "-m", "triton_tlaloc.cli"]
    cmd += ["run", str(art), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
            "32", "--ignore-eos", "--json", "--warmup-runs", "1", "--runtime", runtime]
    env = {**os.environ, "TLALOC_CACHE_DIR": str(cache / runtime)}
    t0 = time.perf_counter()
    # GNU time reports the process's peak resident memory (the kernel's maxrss) on stderr
    run = subprocess.run(["/usr/bin/time", "-f", "maxrss_kib %M", *cmd], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"{runtime}: tlaloc run failed:\n{run.stderr[-3000:]}")
    got = json.loads(run.stdout)
    rss = int(re.findall(r"maxrss_kib (\d+)", run.stderr)[-1]) / 1024
    return {"ms_per_token": got["ms_per_token"], "prefill_ms": got["prefill_ms"],
            "wall_s": wall, "ids": got["generated_ids"], "rss_mib": rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    art = Path(a.artifact) if a.artifact else smollm2(ROOT / "artifacts" / "capi-bench-smollm2")
    rng = random.Random(0)
    runs = {"jax": [], "capi": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            prompt = [rng.randrange(100, 40000) for _ in range(64)]
            ids = {}
            for runtime in ("jax", "capi"):
                got = one_run(art, runtime, prompt, Path(tmp))
                ids[runtime] = got.pop("ids")
                print(f"round {r}: {runtime}: {got}", flush=True)
                if r:
                    runs[runtime].append(got)
            assert ids["jax"] == ids["capi"], f"round {r}: the runtimes' greedy ids differ"
    print(f"\n{art.name}: 32 tokens after a 64-token prompt, one process per run; medians of "
          f"{a.rounds - 1} rounds\n")
    print("| runtime | decode ms/token | prefill ms | process wall s | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|")
    med = {rt: {k: statistics.median(x[k] for x in v) for k in v[0]} for rt, v in runs.items()}
    for rt, m in med.items():
        print(f"| {rt} | {m['ms_per_token']:.2f} | {m['prefill_ms']:.1f} | {m['wall_s']:.2f} | "
              f"{m['rss_mib']:.0f} |")
    j, c = med["jax"], med["capi"]
    print(f"\ncapi / jax: decode {c['ms_per_token'] / j['ms_per_token']:.2f}x, prefill "
          f"{c['prefill_ms'] / j['prefill_ms']:.2f}x, wall {c['wall_s'] / j['wall_s']:.2f}x, "
          f"peak RSS {c['rss_mib'] / j['rss_mib']:.2f}x; the same greedy ids every round")
    return 0


if __name__ == "__main__":
    sys.exit(main())

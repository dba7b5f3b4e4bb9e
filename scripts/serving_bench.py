#!/usr/bin/env python3
"""A real model served: the sequence model driven by a client against the generate model.

Serves an artifact (by default artifacts/smollm2-f32-loop: SmolLM2-135M with f32 weights,
`.venv/bin/tlaloc export smollm2 artifacts/smollm2-f32-loop --weight-dtype f32`, run first when
the directory is missing) from one tritonserver, every entry compiled before the first request,
and for N concurrent sequences measures side by side in one run:

- `sequence`: client-side greedy through the sequence model from one asyncio gRPC client, each
  sequence a START of 4 ids then one request a token (ARGMAX back);
- `generate`: the generate model, N concurrent gRPC streams, input_ids, greedy, ignore_eos,
  its loop in the sequence model's process;
- `generate_bls`: the same through a generate model that makes a BLS call a token (the loop
  before the local one, `generation_loop` bls).

Per path and N: tokens/s (generated tokens over the run's wall time), time to first token and
time per output token (p50, p99), and the generate model's ratio to client-side greedy. Medians
of --runs runs after a warm-up run; the paths alternate within a run.

    .venv/bin/python scripts/serving_bench.py [--artifact artifacts/smollm2-f32-loop]
        [--sequences 1,4,16] [--tokens 32] [--runs 3] [--out artifacts/serving_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from simulated_bench import one_run  # noqa: E402
from transport_bench import add_answering_arguments, answering_options, log  # noqa: E402
from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.repository import (RepositoryOptions, write_generate_model,  # noqa: E402
                                      write_repository)
from triton_tlaloc.triton.server import TritonServer  # noqa: E402

PATHS = ("sequence", "generate", "generate_bls")
DEFAULT_ARTIFACT = ROOT / "artifacts" / "smollm2-f32-loop"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--sequences", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    add_answering_arguments(ap)
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "serving_bench.json")
    args = ap.parse_args()
    counts = [int(n) for n in args.sequences.split(",")]
    if not args.artifact.exists() and args.artifact == DEFAULT_ARTIFACT:
        log(f"exporting SmolLM2 with f32 weights to {args.artifact} ...")
        subprocess.run([str(Path(sys.executable).parent / "tlaloc"), "export", "smollm2",
                        str(args.artifact), "--weight-dtype", "f32"], check=True)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tlaloc-serving-") as tmp:
        repo = Path(tmp) / "repo"
        write_repository(args.artifact, repo, "served", RepositoryOptions(
            **answering_options(args), background_compile=False))
        write_generate_model(load_artifact(args.artifact), repo, "served", "bls",
                             "served_generate_bls")
        with TritonServer(repo) as server:
            log(f"tritonserver ready ({os.cpu_count()} cores), {args.artifact}")
            for r in range(args.runs + 1):  # run 0 warms up
                for n in counts:
                    for p in PATHS:
                        got = asyncio.run(one_run(server.grpc_url, p, n, args.tokens, "served"))
                        if r > 0:
                            results.setdefault((p, n), []).append(got)
                log(f"run {r}{' (warm-up)' if r == 0 else ''} done")
    rows = report(results, counts, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cores": os.cpu_count(), "artifact": str(args.artifact),
                                    "tokens": args.tokens, "runs": args.runs, "rows": rows},
                                   indent=1))


def report(results: dict, counts: list[int], args) -> list[dict]:
    print(f"\n{args.artifact.name}: {args.tokens} tokens per sequence after a START of 4 ids, "
          f"medians of {args.runs} runs; {os.cpu_count()} cores, client and server on this "
          f"machine\n")
    print("| sequences | client greedy tokens/s | generate model tokens/s | generate / client | "
          "BLS loop tokens/s | BLS / client | client TPOT p50 / p99 ms | "
          "generate TPOT p50 / p99 ms | generate TTFT p50 ms |")
    print("|---:|---:|---:|---:|---:|---:|---|---|---:|")
    rows = []
    for n in counts:
        row = {"sequences": n}
        for p in PATHS:
            runs = results[(p, n)]
            row[p] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["ratio"] = row["generate"]["tokens_per_s"] / row["sequence"]["tokens_per_s"]
        row["bls_ratio"] = row["generate_bls"]["tokens_per_s"] / row["sequence"]["tokens_per_s"]
        rows.append(row)
        s, g, b = row["sequence"], row["generate"], row["generate_bls"]
        print(f"| {n} | {s['tokens_per_s']:.1f} | {g['tokens_per_s']:.1f} | {row['ratio']:.2f} | "
              f"{b['tokens_per_s']:.1f} | {row['bls_ratio']:.2f} | "
              f"{s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} | "
              f"{g['tpot_p50_ms']:.1f} / {g['tpot_p99_ms']:.1f} | {g['ttft_p50_ms']:.0f} |")
    return rows


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The serving path at a device's step rate and batch sizes, by simulation.

Serves the tiny llama (exported with batches 1 to 64) in the benchmark mode `simulate_step_ms`
(runtime/simulated.py: every call a wait of a fixed duration, logits that are not the model's; the
server runs with TLALOC_BENCHMARK_MODE=1), so that everything but the executable runs as
served: Triton, requests and responses, the batcher and its page policy, the step inputs, the
generate model. For N concurrent sequences it measures, against the step-bound limit (N tokens a
step, N / step time tokens/s):

- the sequence model, from one asyncio gRPC client (tritonclient grpc.aio): N sequences, each a
  START of 4 tokens then one request per token (greedy on the client from ARGMAX);
- the generate model: N concurrent gRPC streams (one asyncio client), input_ids, greedy,
  ignore_eos; its loop in the sequence model's process (`generate`, the default), and the
  control `generate_bls`: a generate model of the same sequence model making a BLS call a
  token (`generation_loop` bls).

Per path and N: tokens/s (generated tokens over the wall time of the whole run), its ratio to the
limit, time to first token and time per output token (p50, p99; a response carrying k tokens
counts its gap k times at gap / k). Medians of --runs runs after a warm-up run. Writes JSON
and, with matplotlib (pip install 'triton-tlaloc[bench]'), a PNG.

    .venv/bin/python scripts/simulated_bench.py [--step-ms 10] [--sequences 1,4,16,64]
        [--tokens 64] [--runs 3] [--out artifacts/simulated_bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.frontends.client import new_sequence_id  # noqa: E402
from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.repository import (RepositoryOptions, write_generate_model,  # noqa: E402
                                      write_repository)
from triton_tlaloc.triton.server import TritonServer  # noqa: E402
from triton_tlaloc.runtime.simulated import BENCHMARK_ENV  # noqa: E402
from transport_bench import (PROMPT, add_answering_arguments, answering_options,  # noqa: E402
                             log, tiny_artifact)

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def percentiles(values: list[float]) -> tuple[float, float]:
    a = np.array(values) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


class Stream:
    """What one sequence saw: when each response came and how many tokens it carried."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[tuple[float, int]] = []

    def got(self, n: int) -> None:
        if n:
            self.events.append((time.perf_counter(), n))

    @property
    def ttft(self) -> float:
        return self.events[0][0] - self.t0

    def per_token(self) -> list[float]:
        out = []
        for (t_prev, _), (t, n) in zip(self.events, self.events[1:]):
            out += [(t - t_prev) / n] * n
        return out


async def sequence_model(client, model: str, i: int, tokens: int) -> Stream:
    import tritonclient.grpc.aio as grpcaio

    sid = new_sequence_id()
    stream = Stream()
    ids = [(sid + 7 * j) % 250 + 3 for j in range(PROMPT)]
    for step in range(tokens):
        t = grpcaio.InferInput("TOKENS", [1, len(ids)], "INT32")
        t.set_data_from_numpy(np.array([ids], np.int32))
        result = await client.infer(model, [t], outputs=[grpcaio.InferRequestedOutput("ARGMAX")],
                                    sequence_id=sid, sequence_start=step == 0,
                                    sequence_end=step == tokens - 1)
        stream.got(1)
        ids = [int(result.as_numpy("ARGMAX").reshape(-1)[0])]
    return stream


async def generate_model(client, model: str, i: int, tokens: int) -> Stream:
    import tritonclient.grpc.aio as grpcaio

    ids = np.array([(i * 7919 + 7 * j) % 250 + 3 for j in range(PROMPT)], np.int32)
    inputs = [grpcaio.InferInput("input_ids", [PROMPT], "INT32")]
    inputs[0].set_data_from_numpy(ids)
    sampling = json.dumps({"max_tokens": tokens, "ignore_eos": True}).encode()
    inputs.append(grpcaio.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[1].set_data_from_numpy(np.array([sampling], dtype=np.object_))
    inputs.append(grpcaio.InferInput("stream", [1], "BOOL"))
    inputs[2].set_data_from_numpy(np.array([True]))

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": str(i)}

    stream = Stream()
    got = 0
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(f"generate stream {i}: {error}")
        ids_out = result.as_numpy("token_ids")
        n = 0 if ids_out is None else int(ids_out.size)
        stream.got(n)
        got += n
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    if got != tokens:
        raise RuntimeError(f"generate stream {i}: {got} tokens, expected {tokens}")
    return stream


async def one_run(url: str, path: str, n: int, tokens: int, name: str = "tiny") -> dict:
    """N sequences of `tokens` tokens through the sequence model `name` (path "sequence"), its
    generate model (path "generate") or its BLS-loop generate model ("generate_bls") at once."""
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    run = sequence_model if path == "sequence" else generate_model
    model = name if path == "sequence" else f"{name}_{path}"
    try:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(run(client, model, i, tokens) for i in range(n)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    ttft = percentiles([s.ttft for s in streams])
    tpot = percentiles([g for s in streams for g in s.per_token()])
    return {"tokens_per_s": n * tokens / wall, "ttft_p50_ms": ttft[0], "ttft_p99_ms": ttft[1],
            "tpot_p50_ms": tpot[0], "tpot_p99_ms": tpot[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--sequences", default="1,4,16,64")
    ap.add_argument("--paths", default="sequence,generate,generate_bls")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    add_answering_arguments(ap)
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "simulated_bench")
    args = ap.parse_args()
    counts = [int(n) for n in args.sequences.split(",")]
    paths = args.paths.split(",")
    os.environ[BENCHMARK_ENV] = "1"  # the server inherits it: the benchmark mode is allowed
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tlaloc-simulated-") as tmp:
        work = Path(tmp)
        art = tiny_artifact(work, BATCHES, max(BATCHES), args.tokens)
        write_repository(art, work / "repo", "tiny", RepositoryOptions(
            **answering_options(args),
            extra_parameters={"simulate_step_ms": str(args.step_ms)}))
        write_generate_model(load_artifact(art), work / "repo", "tiny", "bls",
                             "tiny_generate_bls")
        with TritonServer(work / "repo") as server:
            log(f"tritonserver ready ({os.cpu_count()} cores); simulated step {args.step_ms} ms")
            for r in range(args.runs + 1):  # run 0 warms up
                for n in counts:
                    for p in paths:
                        got = asyncio.run(one_run(server.grpc_url, p, n, args.tokens))
                        if r > 0:
                            results.setdefault(p, {}).setdefault(n, []).append(got)
                log(f"run {r}{' (warm-up)' if r == 0 else ''} done")
    table = report(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulated_bench.json").write_text(json.dumps(table, indent=1))
    plot(table, args.out)


def report(results: dict, args) -> dict:
    print(f"\nsimulated step {args.step_ms} ms, {args.tokens} tokens per sequence, medians of "
          f"{args.runs} runs; {os.cpu_count()} cores, client and server on this machine\n")
    print("| path | sequences | tokens/s | step-bound limit | ratio | TTFT p50 / p99 ms "
          "| TPOT p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---|---|")
    rows = []
    for p, by_n in results.items():
        for n, runs in sorted(by_n.items()):
            row = {"path": p, "sequences": n,
                   **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            row["limit"] = n * 1e3 / args.step_ms
            row["ratio"] = row["tokens_per_s"] / row["limit"]
            rows.append(row)
            print(f"| {p} | {n} | {row['tokens_per_s']:.0f} | {row['limit']:.0f} | "
                  f"{row['ratio']:.2f} | {row['ttft_p50_ms']:.1f} / {row['ttft_p99_ms']:.1f} | "
                  f"{row['tpot_p50_ms']:.1f} / {row['tpot_p99_ms']:.1f} |")
    return {"cores": os.cpu_count(), "step_ms": args.step_ms, "tokens": args.tokens,
            "runs": args.runs, "rows": rows}


def plot(table: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"wrote {out}/simulated_bench.json (no plot: matplotlib is not installed)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in sorted({r["path"] for r in table["rows"]}):
        rows = [r for r in table["rows"] if r["path"] == p]
        ns = [r["sequences"] for r in rows]
        a.plot(ns, [r["tokens_per_s"] for r in rows], marker="o", label=p)
        b.plot(ns, [r["tpot_p99_ms"] for r in rows], marker="o", label=p)
    ns = sorted({r["sequences"] for r in table["rows"]})
    a.plot(ns, [n * 1e3 / table["step_ms"] for n in ns], "k--", label="step-bound limit")
    for ax, label in ((a, "tokens/s"), (b, "p99 time per output token, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"simulated {table['step_ms']} ms step, {table['cores']} cores")
    fig.tight_layout()
    fig.savefig(out / "simulated_bench.png", dpi=100)
    log(f"wrote {out}/simulated_bench.json and .png")


if __name__ == "__main__":
    main()

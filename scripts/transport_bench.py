#!/usr/bin/env python3
"""The transport's ceiling, measured next to the real model in one run.

Serves, from one tritonserver, the project's tiny llama (a seeded random checkpoint built with
transformers, exported with batches 1, 2 and 4) and models that do nothing but answer
(scripts/transport_ceiling_model.py) under the same config.pbtxt: `ceiling` answers as the
sequence model does (its reply threads send each response), `ceiling_execute` returns a call's
responses from execute() (one message to Triton for all of them: the fastest the Python
backend answers). A control, `tiny_inline`, is the tiny llama as it answered before the reply
threads: every reply sent by the batching thread, the cohort wait bounded by
cohort_wait_microseconds alone. One asyncio client per protocol (tritonclient's grpc.aio and
http.aio) drives N sequences at once, each a START of 4 tokens then --steps requests of one
token (the last with END), each sent when the previous reply arrived, as a decoding client does. It prints requests/s
for each model at each N over gRPC and HTTP and the real model's ratio to the ceiling, measured
back to back (medians of --runs rounds after a warm-up round; the models alternate within a
round, so all see the same machine), and at one sequence where the real model's time goes: per
decode call, the backend's phases (its metrics) and the executable's share.

    .venv/bin/python scripts/transport_bench.py [--sequences 1,4,16,64] [--steps 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, metric,  # noqa: E402
                                            new_sequence_id, scrape_metrics)
from triton_tlaloc.scheduling.observer import CallTiming  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402

PROMPT = 4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tiny_artifact(work: Path, batches: tuple[int, ...], max_sequences: int, tokens: int) -> Path:
    """The tiny llama (a seeded random transformers checkpoint) exported with these batches, one
    context that holds a START of PROMPT tokens and `tokens` more, and pages for
    `max_sequences` such sequences at once."""
    from checks.oracle import make_tiny_checkpoint

    from triton_tlaloc.export import ExportOptions, export_artifact

    ckpt = make_tiny_checkpoint(work / "ckpt", "llama")
    context = 1 << (PROMPT + tokens - 1).bit_length()
    return export_artifact(ckpt, work / "art", ExportOptions(
        batch_ladder=batches, context_ladder=(context,), block_size=8,
        num_blocks=max_sequences * context // 8 + 1))


def add_answering_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of how the sequence model answers, which the benchmarks vary."""
    ap.add_argument("--cohort-wait-us", type=int,
                    default=RepositoryOptions.cohort_wait_microseconds)
    ap.add_argument("--cohort-wait-steps", type=float,
                    default=RepositoryOptions.cohort_wait_steps)
    ap.add_argument("--reply-threads", type=int, default=RepositoryOptions.reply_threads)


def answering_options(args) -> dict:
    """add_answering_arguments' values as RepositoryOptions fields."""
    return dict(cohort_wait_microseconds=args.cohort_wait_us,
                cohort_wait_steps=args.cohort_wait_steps, reply_threads=args.reply_threads)


MODELS = ("ceiling", "ceiling_execute", "tiny", "tiny_inline")
# The control: replies sent by the batching thread, the cohort wait not bounded by the step
INLINE = dict(reply_threads=0, cohort_wait_steps=0)


def write_models(art: Path, repo: Path, options: RepositoryOptions) -> None:
    """The tiny model as `tiny`, the control as `tiny_inline`, and the ceilings under the tiny
    model's config: `ceiling` sends from as many threads as the tiny model's reply threads,
    `ceiling_execute` answers from execute()."""
    write_repository(art, repo, "tiny", options)
    write_repository(art, repo, "tiny_inline", dataclasses.replace(options, **INLINE))
    config = (repo / "tiny" / "config.pbtxt").read_text()
    for name, threads in (("ceiling", max(1, options.reply_threads)), ("ceiling_execute", 0)):
        (repo / name / "1").mkdir(parents=True)
        own = config.replace('name: "tiny"', f'name: "{name}"', 1).replace(
            "parameters [\n", f'parameters [\n  {{ key: "sender_threads" value: '
            f'{{ string_value: "{threads}" }} }},\n', 1)
        (repo / name / "config.pbtxt").write_text(own)
        shutil.copy(ROOT / "scripts" / "transport_ceiling_model.py",
                    repo / name / "1" / "model.py")


class Driver:
    """One asyncio client of a protocol; `run` drives N sequences against a model."""

    def __init__(self, protocol: str, url: str):
        self.protocol = protocol
        if protocol == "grpc":
            import tritonclient.grpc.aio as client
            import tritonclient.grpc as types
        else:
            import tritonclient.http.aio as client
            import tritonclient.http as types
        self.types = types
        self.client = client.InferenceServerClient(url)

    async def request(self, model: str, sid: int, tokens: list[int], start: bool, end: bool):
        t = self.types
        tokens_in = t.InferInput("TOKENS", [1, len(tokens)], "INT32")
        tokens_in.set_data_from_numpy(np.array([tokens], np.int32))
        result = await self.client.infer(model, [tokens_in],
                                         outputs=[t.InferRequestedOutput("ARGMAX")],
                                         sequence_id=sid, sequence_start=start,
                                         sequence_end=end)
        return int(result.as_numpy("ARGMAX").reshape(-1)[0])

    async def sequence(self, model: str, i: int, steps: int, latencies: list[float]) -> None:
        sid = new_sequence_id()
        # unique prompts; the steps feed fixed ids so both models see the same requests
        tokens = [(sid + 7 * j) % 250 + 3 for j in range(PROMPT)]
        t0 = time.perf_counter()
        await self.request(model, sid, tokens, True, False)
        latencies.append(time.perf_counter() - t0)
        for s in range(steps):
            t0 = time.perf_counter()
            await self.request(model, sid, [(i * 31 + s) % 250 + 3], False, s == steps - 1)
            latencies.append(time.perf_counter() - t0)

    async def run(self, model: str, sequences: int, steps: int) -> dict:
        latencies: list[float] = []
        t0 = time.perf_counter()
        await asyncio.gather(*(self.sequence(model, i, steps, latencies)
                               for i in range(sequences)))
        wall = time.perf_counter() - t0
        ms = np.array(latencies) * 1e3
        return {"requests_per_s": len(latencies) / wall, "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99))}

    async def close(self) -> None:
        await self.client.close()


async def bench(server: TritonServer, args) -> dict:
    drivers = {"grpc": Driver("grpc", server.grpc_url), "http": Driver("http", server.http_url)}
    protocols = args.protocols.split(",")
    counts = [int(n) for n in args.sequences.split(",")]
    results: dict = {}
    try:
        for r in range(args.runs + 1):  # round 0 is the warm-up
            for n in counts:
                for p in protocols:
                    for model in MODELS:
                        before = (scrape_metrics(server.metrics_url) if model == "tiny"
                                  else {})
                        got = await drivers[p].run(model, n, args.steps)
                        if model == "tiny":
                            got["calls"] = call_phases(before, scrape_metrics(
                                server.metrics_url, settle_s=METRICS_SETTLE_S))
                        if r > 0:
                            results.setdefault((p, n, model), []).append(got)
            log(f"round {r}{' (warm-up)' if r == 0 else ''} done")
    finally:
        for d in drivers.values():
            await d.close()
    return results


def call_phases(before: dict, after: dict) -> dict:
    """Per decode call of the tiny model between two scrapes: ms in each phase of the backend
    (metrics.CallTiming) and rows."""
    calls = (metric(after, "tlaloc_executions_total", model="tiny", kind="decode")
             - metric(before, "tlaloc_executions_total", model="tiny", kind="decode"))
    out = {"decode_calls": calls}
    for phase in CallTiming.PHASES:
        labels = dict(model="tiny", kind="decode", phase=phase)
        spent = (metric(after, "tlaloc_call_phase_seconds_total", **labels)
                 - metric(before, "tlaloc_call_phase_seconds_total", **labels))
        out[phase] = spent / calls * 1e3 if calls else 0.0
    return out


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def report(results: dict, args) -> dict:
    print(f"\nrequests/s, medians of {args.runs} rounds ({args.steps} one-token requests per "
          f"sequence after a START of {PROMPT}; {os.cpu_count()} cores, client and server on "
          f"this machine):\n")
    print("| protocol | sequences | ceiling req/s | tiny llama req/s | tiny / ceiling | "
          "answered from execute() req/s | ceiling p50 / p99 ms | tiny p50 / p99 ms | "
          "control: replies sent by the batching thread req/s | tiny / control |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|---:|")
    table = []
    for (p, n, model), runs in sorted(results.items()):
        if model != "ceiling":
            continue
        tiny, execute = results[(p, n, "tiny")], results[(p, n, "ceiling_execute")]
        inline = results[(p, n, "tiny_inline")]
        row = {"protocol": p, "sequences": n,
               "ceiling": median_of(runs, "requests_per_s"),
               "tiny": median_of(tiny, "requests_per_s"),
               "tiny_inline": median_of(inline, "requests_per_s"),
               "ceiling_execute": median_of(execute, "requests_per_s"),
               "ceiling_p50_ms": median_of(runs, "p50_ms"),
               "ceiling_p99_ms": median_of(runs, "p99_ms"),
               "tiny_p50_ms": median_of(tiny, "p50_ms"), "tiny_p99_ms": median_of(tiny, "p99_ms"),
               "tiny_decode_call_ms": {k: statistics.median(r["calls"][k] for r in tiny)
                                       for k in tiny[0]["calls"]}}
        row["ratio"] = row["tiny"] / row["ceiling"]
        table.append(row)
        print(f"| {p} | {n} | {row['ceiling']:.0f} | {row['tiny']:.0f} | {row['ratio']:.2f} | "
              f"{row['ceiling_execute']:.0f} | "
              f"{row['ceiling_p50_ms']:.2f} / {row['ceiling_p99_ms']:.2f} | "
              f"{row['tiny_p50_ms']:.2f} / {row['tiny_p99_ms']:.2f} | "
              f"{row['tiny_inline']:.0f} | {row['tiny'] / row['tiny_inline']:.2f} |")
    print("\nthe tiny model's decode calls, ms per call (medians of the rounds' means):\n")
    print("| protocol | sequences | rows a call | " + " | ".join(CallTiming.PHASES) +
          " | backend overhead (all but wait and the executable) |")
    print("|---|---:|---:|" + "---:|" * (len(CallTiming.PHASES) + 1))
    for row in table:
        c = row["tiny_decode_call_ms"]
        overhead = sum(c[k] for k in CallTiming.PHASES if k not in ("wait", "execute"))
        row["backend_overhead_ms"] = overhead
        calls = c["decode_calls"]
        rows = row["sequences"] * args.steps / calls if calls else 0
        print(f"| {row['protocol']} | {row['sequences']} | {rows:.1f} | " +
              " | ".join(f"{c[k]:.3f}" for k in CallTiming.PHASES) + f" | {overhead:.3f} |")
    return {"cores": os.cpu_count(), "steps": args.steps, "runs": args.runs, "rows": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", default="1,4,16,64")
    ap.add_argument("--protocols", default="grpc,http")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    add_answering_arguments(ap)
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()
    counts = [int(n) for n in args.sequences.split(",")]
    with tempfile.TemporaryDirectory(prefix="tlaloc-transport-") as tmp:
        work = Path(tmp)
        log("building the tiny llama and its repository ...")
        art = tiny_artifact(work, (1, 2, 4), max(counts), args.steps)
        write_models(art, work / "repo", RepositoryOptions(generate_model=False,
                                                           **answering_options(args)))
        with TritonServer(work / "repo") as server:
            log(f"tritonserver ready: {server.grpc_url} (gRPC), {server.http_url} (HTTP)")
            results = asyncio.run(bench(server, args))
    summary = report(results, args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

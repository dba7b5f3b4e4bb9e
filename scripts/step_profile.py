#!/usr/bin/env python3
"""The step profile: where a decode step's time goes, through a real tritonserver.

Serves an artifact (SmolLM2 by default) with the backend's timing log on (model parameter
timing_log), runs decode steps with 1 and with 4 sequences over gRPC, and prints per step:

- the client's time for a step (request sent to logits received);
- Triton's queue and compute times per request (its statistics API, means);
- the backend's phases from its timing log (metrics.CallTiming, medians over the calls): the wait
  (arrival in execute() to the start of the round), admission, building the step inputs, putting
  them on the device, the executable, the logits copy, the replies, the rest;
- the backend overhead: the backend's time for a call (admission to the last reply) minus the
  executable's, and the wait before it;
- the executable alone, run in a loop in this process after the server has stopped (no server,
  no batcher: the same entry at the same context).

Method: --warmup steps first (in sequences of their own, so that the measured one decodes at
the smallest context bucket); every figure is over --steps steps; prompts are unique; nothing
else should run on the machine.

    .venv/bin/python scripts/step_profile.py [--artifact artifacts/smollm2-f32] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.scheduling.observer import CallTiming  # noqa: E402
from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, TlalocClient, metric,  # noqa: E402
                                  new_sequence_id, scrape_metrics)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_artifact(path: Path, weight_dtype: str) -> Path:
    if not (path / "tlaloc-serving.json").is_file():
        from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path
        from triton_tlaloc.export import ExportOptions, export_artifact

        log(f"exporting SmolLM2 ({weight_dtype}) to {path} ...")
        export_artifact(smollm2_gguf_path(), path, ExportOptions(
            batch_ladder=(1, 2, 4), context_ladder=(128, 512), weight_dtype=weight_dtype))
    return path


def decode_run(url: str, metrics_url: str, model: str, rows: int, prompt_len: int, warmup: int,
               steps: int, seed: int, timing_log: Path) -> dict:
    """`rows` sequences stepping concurrently; client step times, Triton's statistics and the
    backend's timing-log lines of the measured steps."""
    barrier = threading.Barrier(rows + 1)
    step_ms: list[list[float]] = [[] for _ in range(rows)]
    errors = []

    def worker(i: int) -> None:
        try:
            with TlalocClient(url, model, "grpc") as c:
                # The warm-up runs in sequences of at most 32 steps, so the measured sequence
                # decodes at the smallest context that holds its prompt and steps.
                done = 0
                while done < warmup:
                    n = min(32, warmup - done)
                    c.generate_greedy([7 + i, 11 + done % 1000], n)
                    done += n
                sid = new_sequence_id()
                prompt = [(seed * 7919 + i * 104729 + j * 31) % 5000 + 10
                          for j in range(prompt_len)]
                logits, _ = c.infer(sid, prompt, start=True)
                token = int(logits.argmax())
                barrier.wait()  # the main thread marks the log and the statistics here
                barrier.wait()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    logits, _ = c.infer(sid, [token])
                    step_ms[i].append((time.perf_counter() - t0) * 1e3)
                    token = int(logits.argmax())
                barrier.wait()
                c.infer(sid, [], end=True)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(rows)]
    for t in threads:
        t.start()
    try:
        with TlalocClient(url, model, "grpc") as c:
            barrier.wait()
            mark = timing_log.stat().st_size
            before = c.inference_statistics()
            sends_before = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
            barrier.wait()
            barrier.wait()
            after = c.inference_statistics()
            sends_after = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    except threading.BrokenBarrierError:
        pass  # a worker failed: its error is raised below
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    with timing_log.open() as f:
        f.seek(mark)
        calls = [json.loads(x) for x in f.read().splitlines()]
    calls = [x for x in calls if x["kind"] == "decode"]
    triton = {}
    for k in ("queue", "compute_input", "compute_infer", "compute_output"):
        n = after[k][0] - before[k][0]
        triton[k] = (after[k][1] - before[k][1]) / max(n, 1) / 1e6
    sends = {k: metric(sends_after, f"tlaloc_response_send_seconds_{k}")
             - metric(sends_before, f"tlaloc_response_send_seconds_{k}") for k in ("sum", "count")}
    return {"rows": rows, "steps": steps, "client_ms": statistics.median(
                x for s in step_ms for x in s),
            "triton_ms": triton, "calls": len(calls),
            "rows_per_call": statistics.mean(x["rows"] for x in calls),
            "entry": statistics.mode(x["entry"] for x in calls),
            "backend_ms": {p: statistics.median(x[f"{p}_ms"] for x in calls)
                           for p in (*CallTiming.PHASES, "total")},
            "overhead_ms": statistics.median(x["total_ms"] - x["execute_ms"] for x in calls),
            "send_ms": sends["sum"] / max(sends["count"], 1) * 1e3}


def executable_alone(artifact: Path, entry_name: str, runs: int) -> float:
    """Median ms of the entry's executable run in a loop in this process (the runtime's execute
    phase: inputs already built, no server)."""
    from triton_tlaloc.runtime.core import Runtime
    from triton_tlaloc.engine.steps import Row, build_step

    rt = Runtime(artifact, entries=[entry_name])
    entry = rt.artifact.entries[entry_name]
    bs = rt.artifact.model.block_size
    step = build_step(entry, [Row((5,), 40, tuple(range(1 + 4 * r, 5 + 4 * r)))
                              for r in range(entry.batch)], bs)
    for _ in range(5):
        rt.run(entry_name, step)
    times = []
    for _ in range(runs):
        before = rt.phase_seconds["execute"]
        rt.run(entry_name, step)
        times.append((rt.phase_seconds["execute"] - before) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=None,
                    help="default: artifacts/smollm2-<weight dtype> (exported when missing)")
    ap.add_argument("--weight-dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--rows", default="1,4", help="concurrent sequences, one run each")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=100,
                    help="steps before measuring (past the runtime's first 100 runs, whose "
                         "pool addresses are checked)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "profile")
    args = ap.parse_args()

    from triton_tlaloc.repository import RepositoryOptions, write_repository
    from triton_tlaloc.triton.server import TritonServer

    artifact = ensure_artifact(args.artifact or ROOT / "artifacts" / f"smollm2-{args.weight_dtype}",
                               args.weight_dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    timing_log = (args.out / "timing.jsonl").resolve()
    timing_log.unlink(missing_ok=True)
    rows_list = [int(x) for x in args.rows.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_repository(artifact, repo, "model", RepositoryOptions(
            extra_parameters={"timing_log": str(timing_log)}))
        server = TritonServer(repo, log_path=args.out / "tritonserver.log")
        log(f"starting tritonserver (log {server.log_path}) ...")
        with server:
            for i, rows in enumerate(rows_list):
                log(f"{rows} sequence(s): {args.warmup} warm-up steps, {args.steps} measured ...")
                results.append(decode_run(server.grpc_url, server.metrics_url, "model", rows,
                                          args.prompt_len,
                                          args.warmup, args.steps, args.seed + 100 * i,
                                          timing_log))
    log("the executable alone ...")
    for r in results:
        r["executable_alone_ms"] = executable_alone(artifact, r["entry"], max(20, args.steps // 2))

    name = json.loads((artifact / "tlaloc-serving.json").read_text())["model"]["modelName"]
    print(f"\nStep profile: {name} ({artifact.name}), decode over gRPC, {args.steps} steps after "
          f"{args.warmup} warm-up; Triton figures are means, the rest medians (ms)\n")
    cols = [f"{r['rows']} seq ({r['entry']})" for r in results]
    print(f"{'':<40}" + "".join(f"{c:>26}" for c in cols))

    def row(label, values, fmt="{:.3f}"):
        print(f"{label:<40}" + "".join(f"{fmt.format(v):>26}" for v in values))

    row("client: a step", [r["client_ms"] for r in results])
    for k in ("queue", "compute_input", "compute_infer", "compute_output"):
        row(f"Triton: {k}", [r["triton_ms"][k] for r in results])
    for p in CallTiming.PHASES:
        row(f"backend: {p}", [r["backend_ms"][p] for r in results])
    row("backend: a call, admission to last reply", [r["backend_ms"]["total"] for r in results])
    row("a response's send (mean)", [r["send_ms"] for r in results])
    row("rows per call", [r["rows_per_call"] for r in results], "{:.2f}")
    row("the executable alone (no server)", [r["executable_alone_ms"] for r in results])
    row("backend overhead (call - executable)", [r["overhead_ms"] for r in results])
    row("client step - backend call - wait", [r["client_ms"] - r["backend_ms"]["total"]
                                              - r["backend_ms"]["wait"] for r in results])
    if len(results) > 1:
        print(f"\n{results[-1]['rows']}-sequence step / 1-sequence step (client): "
              f"{results[-1]['client_ms'] / results[0]['client_ms']:.2f}x; executable alone: "
              f"{results[-1]['executable_alone_ms'] / results[0]['executable_alone_ms']:.2f}x")
    (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {args.out / 'profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What structured-output requests cost everyone else: a plain chat's time to first token
alone; while 20 clients each ask for a different all-forced regex (`A{600}`, `B{600}`, ...;
max_tokens 16, as /v1/completions' default), and while 4 ask for different schemas that take
llguidance about 1 s each to compile, each beside the same number of plain clients (the load
their prompts alone put on the model); through a real tritonserver and the
generate model (its loop in the sequence model's process, gRPC, greedy).

SmolLM2-135M-Instruct (context 1024, decode batches 1, 4 and 16, prefill entries of one
sequence and 32 or 1024 tokens, a pool of 256 pages of 16 tokens:
exported to --artifact when missing), every entry compiled before the runs. Prints the plain
chat's first-token times (alone, and sent 0.2 s after the 20), the 20's answers by status and
their wall time, and the tokens the sequence model ran (its tlaloc_tokens_total) during the
flood.

    .venv/bin/python scripts/grammar_stall_bench.py [--runs 3] [--clients 20] [--schemas 4]

Nothing else should run on the machine; the figures are for comparing builds on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(1, str(ROOT))

MODEL = "smollm2"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def export_if_missing(path: Path) -> Path:
    if not (path / "tlaloc-serving.json").exists():
        from triton_tlaloc.export import ExportOptions, export_artifact
        from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

        export_artifact(smollm2_gguf_path(), path, ExportOptions(
            batch_ladder=(1, 4, 16), context_ladder=(1024,), prefill_max_batch=1,
            prefill_tokens=(32,), block_size=16, num_blocks=257))
    return path


def plain_first_token_ms(server, prompt: list[int]) -> float:
    from triton_tlaloc.frontends.client import generate

    try:
        got = generate(server.grpc_url, f"{MODEL}_generate", input_ids=prompt,
                       sampling={"max_tokens": 8})
    except TimeoutError:  # nothing within the client's 120 s
        return float("inf")
    assert got.error is None, got.error
    return got.first_token_ms


def slow_schema(salt: int) -> dict:
    """A small schema that multiplies out (an allOf of six 3-way anyOfs): about 1 s of
    llguidance's compile on a busy core; its names differ by `salt` (never found compiled)."""
    return {"allOf": [{"anyOf": [{"type": "object", "properties": {
        f"s{salt}_{i}_{j}": {"type": "integer"}}} for j in range(3)]} for i in range(6)]}


def flood(server, prompt: list[int], clients: int, run: int,
          kind: str) -> tuple[float, dict, float]:
    """`clients` requests at once (`kind`: "plain", none constrained, the load alone;
    "regex", all-forced regexes; "schema", slow schemas) and a plain chat 0.2 s later: (the
    plain chat's first token ms, the clients' answers by status or finish reason, the
    flood's seconds)."""
    from triton_tlaloc.frontends.client import generate

    answers: dict[str, int] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        # a different constraint each run too: none found compiled
        letter = LETTERS[(i + run * clients) % len(LETTERS)]
        sampling = {"max_tokens": 16}
        if kind == "regex":
            sampling["structured_output"] = {"regex": f"{letter}{{{600 + run}}}"}
        elif kind == "schema":
            sampling["structured_output"] = {"json_schema": slow_schema(run * 1000 + i)}
        try:
            got = generate(server.grpc_url, f"{MODEL}_generate", input_ids=prompt + [i + 2],
                           sampling=sampling)
            key = got.status or got.finish_reason
            if got.error:
                key += f" ({got.error.split(': ')[-1][:60]})"
        except TimeoutError:  # nothing within the client's 120 s
            key = "no answer in 120 s"
        with lock:
            answers[key] = answers.get(key, 0) + 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    ttft = plain_first_token_ms(server, prompt + [run + 500])
    for t in threads:
        t.join()
    return ttft, answers, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "smollm2-grammar-stall")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--schemas", type=int, default=4, help="clients of the slow-schema runs")
    args = ap.parse_args()

    from spec_bench import serving

    from triton_tlaloc.frontends.client import metric, scrape_metrics

    art = export_if_missing(args.artifact)
    prompt = [1, 9690, 314, 260, 1953, 282]
    with serving(art) as server:
        plain_first_token_ms(server, prompt)  # warm-up
        alone = [plain_first_token_ms(server, prompt + [i + 900]) for i in range(5)]
        print(f"plain chat alone: first token {statistics.median(alone):.0f} ms (median of 5)",
              flush=True)
        for kind, clients in (("plain", args.clients), ("regex", args.clients),
                              ("plain", args.schemas), ("schema", args.schemas)):
            for run in range(args.runs):
                before = metric(scrape_metrics(server.metrics_url, settle_s=0.6),
                                "tlaloc_tokens_total", model=MODEL)
                ttft, answers, seconds = flood(server, prompt, clients, run, kind)
                ran = metric(scrape_metrics(server.metrics_url, settle_s=0.6),
                             "tlaloc_tokens_total", model=MODEL) - before
                print(f"{kind} run {run}: plain chat's first token {ttft:.0f} ms "
                      f"({ttft / statistics.median(alone):.1f}x alone); {clients} clients: "
                      f"{dict(sorted(answers.items()))} in {seconds:.1f} s; {ran:.0f} tokens "
                      f"run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What structured output costs, two ways.

`mask ARTIFACT_DIR`: a step's grammar work on an artifact's tokenizer alone: the mask's
computing (on the worker thread, hidden behind the step's call) and its application to a row of
logits (on the thread that chooses the token, paid by the step), per step of answers written
under a JSON schema, a regex and a choice, chosen greedily from seeded random logits (no model),
so every step is one a model could take. Prints the median, p99 and largest time per step.

`serve`: constrained JSON against free text through a real tritonserver, side by side in one
run. SmolLM2-135M-Instruct (f32, batches 1 and 4, context 512, verify entries of 5 and 9
tokens: exported to --artifact when missing) behind the generate model (its loop in the
sequence model's process). At 1 and at 4 concurrent streams over gRPC, greedy: free text
(--tokens tokens, ignore_eos) and a JSON answer under SCHEMA, alternating, each request's
prompt new (a run number in it). A figure is the median over --runs runs (after a warm-up
run) of the output rate: tokens after the first over the time from the first stream's first
token to the last stream's end. From the sequence model's metrics over the same runs: the calls
of each kind and their mean time, forced tokens (fed without a choice), the mask's compute time
and the waits for a mask the call did not hide.

    .venv/bin/python scripts/structured_bench.py mask ARTIFACT_DIR [--answers 20]
    .venv/bin/python scripts/structured_bench.py serve [--runs 3] [--tokens 64]

Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string",
                                                              "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2} [a-z]{3,8}"},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed feelings"]},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mask")
    m.add_argument("artifact", type=Path)
    m.add_argument("--answers", type=int, default=20, help="answers per constraint")
    s = sub.add_parser("serve")
    s.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "smollm2-structured")
    s.add_argument("--runs", type=int, default=3)
    s.add_argument("--tokens", type=int, default=64, help="free text's tokens")
    s.add_argument("--streams", default="1,4")
    args = ap.parse_args()
    return mask_bench(args) if args.what == "mask" else serve_bench(args)


def mask_bench(args) -> int:

    from triton_tlaloc.artifact.loading import load_artifact
    from triton_tlaloc.generation.grammar import Grammars
    from triton_tlaloc.generation.token_constraint import GrammarObserver
    from triton_tlaloc.generation.structured import StructuredOutput

    class MaskTimes(GrammarObserver):
        def __init__(self):
            self.seconds = []

        def masked(self, seconds):
            self.seconds.append(seconds)

    art = load_artifact(args.artifact)
    vocab, eos = art.model.vocab, list(art.model.eos_token_ids)
    times = MaskTimes()
    grammars = Grammars(art.tokenizer_dir, vocab, eos, observer=times)
    t0 = time.perf_counter()
    grammars.tokenizer()
    print(f"llguidance's tokenizer: {time.perf_counter() - t0:.2f} s, {vocab} tokens")
    rng = np.random.default_rng(0)
    print(f"{'constraint':<12} {'steps':>6} {'compile ms':>11} {'mask median us':>15} "
          f"{'p99 us':>8} {'max us':>8} {'apply median us':>16}")
    for name, d in CONSTRAINTS.items():
        spec = StructuredOutput.from_dict(d)
        t0 = time.perf_counter()
        grammars.constraint(spec, set(eos))  # compiled (its first mask too), then cached
        compile_ms = (time.perf_counter() - t0) * 1e3
        times.seconds, applies, steps = [], [], 0
        for _ in range(args.answers):
            c = grammars.constraint(spec, set(eos))
            for _ in range(500):
                if c.queued:  # forced: no mask, no choice
                    c.took(c.queued[:1])
                    continue
                logits = rng.standard_normal(vocab).astype(np.float32)
                c.allowed()  # the mask, once the worker has it
                t0 = time.perf_counter()
                masked = c.masked(logits)
                token = int(np.argmax(masked))
                applies.append(time.perf_counter() - t0)
                steps += 1
                if token in eos:
                    break
                c.took([token])
        c.allowed()  # the last mask computed
        m = np.array(times.seconds) * 1e6
        print(f"{name:<12} {steps:>6} {compile_ms:>11.1f} {np.median(m):>15.1f} "
              f"{np.percentile(m, 99):>8.1f} {m.max():>8.1f} "
              f"{np.median(applies) * 1e6:>16.1f}")
    grammars.close()
    return 0


MODEL = "smollm2"
KINDS = ("decode", "verify", "prefill")


def export_if_missing(path: Path) -> Path:
    if not (path / "tlaloc-serving.json").exists():
        from triton_tlaloc.export import ExportOptions, export_artifact
        from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

        export_artifact(smollm2_gguf_path(), path, ExportOptions(
            batch_ladder=(1, 4), context_ladder=(512,), weight_dtype="f32",
            verify_tokens=(5, 9)))
    return path


def histogram(values: dict, name: str) -> tuple[float, dict[float, float]]:
    """A scraped histogram of the model's: (count, {upper bound: cumulative count})."""
    from triton_tlaloc.frontends.client import metric

    buckets = {}
    for (n, labels), v in values.items():
        d = dict(labels)
        if n == f"{name}_bucket" and d.get("model") == MODEL:
            buckets[float(d["le"])] = buckets.get(float(d["le"]), 0.0) + v
    return metric(values, f"{name}_count", model=MODEL), buckets


def quantile(hist: tuple[float, dict[float, float]], q: float) -> float:
    """The upper bound of the bucket holding quantile q of a histogram."""
    count, buckets = hist
    for le in sorted(buckets):
        if buckets[le] >= q * count:
            return le
    return float("inf")


def delta(rows: list, key: str) -> tuple[float, dict[float, float]]:
    """A histogram's observations within the runs of `rows` ((tokens, before, after) each)."""
    count, buckets = 0.0, {}
    for _, before, after in rows:
        count += after[key][0] - before[key][0]
        for le, v in after[key][1].items():
            buckets[le] = buckets.get(le, 0.0) + v - before[key][1].get(le, 0.0)
    return count, buckets


def counters(server) -> dict:
    from triton_tlaloc.frontends.client import metric, scrape_metrics

    values = scrape_metrics(server.metrics_url, settle_s=0.6)
    out = {"forced": metric(values, "tlaloc_grammar_forced_tokens_total", model=MODEL)}
    for kind in KINDS:
        out[f"{kind} calls"] = metric(values, "tlaloc_executions_total", model=MODEL, kind=kind)
        out[f"{kind} s"] = metric(values, "tlaloc_execution_seconds_sum", model=MODEL,
                                  kind=kind)
    out["mask"] = histogram(values, "tlaloc_grammar_mask_seconds")
    out["wait"] = histogram(values, "tlaloc_grammar_mask_wait_seconds")
    return out


def one_run(server, prompts: list[list[int]], sampling: dict) -> tuple[int, float, list[str]]:
    """`prompts` sent at once: (tokens after each stream's first, seconds from the first
    first token to the last end, the texts)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton_tlaloc.frontends.client import generate

    def send(prompt):
        t0 = time.perf_counter()
        got = generate(server.grpc_url, f"{MODEL}_generate", input_ids=prompt,
                       sampling=sampling)
        assert got.error is None, got.error
        return t0 + got.first_token_ms / 1e3, time.perf_counter(), got

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(send, prompts))
    tokens = sum(len(got.token_ids) - 1 for _, _, got in results)
    seconds = max(end for _, end, _ in results) - min(first for first, _, _ in results)
    return tokens, seconds, [got.text for _, _, got in results]


def serve_bench(args) -> int:
    import json
    import statistics

    import jsonschema

    from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer

    art = export_if_missing(args.artifact)
    tok = ArtifactTokenizer(art / "tokenizer")
    modes = {"free": {"max_tokens": args.tokens, "ignore_eos": True},
             "json": {"max_tokens": 200, "structured_output": {"json_schema": SCHEMA}}}
    ask = "Invent a person: name, age, favourite colours and address. Answer in JSON."
    streams = [int(x) for x in args.streams.split(",")]
    rates = {(n, mode): [] for n in streams for mode in modes}
    totals = {(n, mode): [] for n in streams for mode in modes}
    from spec_bench import serving

    with serving(art) as server:
        for run in range(args.runs + 1):  # run 0 warms up
            for n in streams:
                order = list(modes) if run % 2 else list(modes)[::-1]
                for mode in order:
                    prompts = [tok.apply_chat_template([{
                        "role": "user", "content": f"(request {run}.{i}) {ask}"}])
                        for i in range(n)]
                    before = counters(server)
                    tokens, seconds, texts = one_run(server, prompts, modes[mode])
                    after = counters(server)
                    if mode == "json":
                        for text in texts:
                            jsonschema.validate(json.loads(text), SCHEMA)
                    if run:
                        rates[(n, mode)].append(tokens / seconds)
                        totals[(n, mode)].append((tokens, before, after))
            print(f"run {run}{' (warm-up)' if run == 0 else ''} done", file=sys.stderr,
                  flush=True)
    print(f"\nSmolLM2-135M f32 through the generate model (gRPC, greedy), medians of "
          f"{args.runs} runs; {os.cpu_count()} cores\n")
    print("| streams | output | tokens/s | ratio | tokens a stream | calls (decode/verify) "
          "| mean call ms (decode/verify) | forced tokens | mask p50/p99 us "
          "| waits for a mask (p99 us) |")
    print("|---:|---|---:|---:|---:|---|---|---:|---|---|")
    for n in streams:
        base = statistics.median(rates[(n, "free")])
        for mode in modes:
            rate = statistics.median(rates[(n, mode)])
            rows = totals[(n, mode)]
            d = {k: sum(a[k] - b[k] for _, b, a in rows) for k in rows[0][2]
                 if not isinstance(rows[0][2][k], tuple)}
            ms = [1e3 * d[f"{k} s"] / d[f"{k} calls"] if d[f"{k} calls"] else 0.0
                  for k in ("decode", "verify")]
            mask, wait = delta(rows, "mask"), delta(rows, "wait")
            mask_q = (f"{quantile(mask, 0.5) * 1e6:.0f}/{quantile(mask, 0.99) * 1e6:.0f}"
                      if mask[0] else "-")
            wait_q = f"{wait[0]:.0f} of {mask[0]:.0f}" + (
                f" ({quantile(wait, 0.99) * 1e6:.0f})" if wait[0] else "")
            print(f"| {n} | {mode} | {rate:.1f} | {rate / base:.2f} | "
                  f"{sum(t for t, _, _ in rows) / len(rows) / n:.0f} | "
                  f"{d['decode calls'] / len(rows):.0f}/{d['verify calls'] / len(rows):.0f} | "
                  f"{ms[0]:.1f}/{ms[1]:.1f} | {d['forced'] / len(rows):.0f} | {mask_q} | "
                  f"{wait_q} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Speculative decoding by prompt lookup against plain greedy decoding, side by side in one run.

SmolLM2-135M-Instruct (f32, batch 1, context 512, verify entries of 3, 5, 7 and 9 tokens:
exported to --artifact when missing) through the engine in this process (what `tlaloc run
--speculate K` runs; no server), three kinds of prompt, each as a chat:

- code: edit a given function (the answer repeats most of it);
- quote: answer by quoting a given passage;
- chat: a free question (little to look up).

For each kind and each draft length (0: no speculation, then --lengths), one generation of up
to --tokens greedy tokens (stopping at EOS; the ids are the same at every length, which is
checked); the lengths alternate within a run and each kind's prompt is new in every run (a
run number in it) so nothing is found cached. Medians of --runs runs after a warm-up run:
tokens/s over the decode calls (the prompt's call excluded), the ratio to no speculation, the
acceptance rate (drafts accepted over drafts checked) and tokens per call. JSON to --out.

    .venv/bin/python scripts/spec_bench.py [--runs 3] [--tokens 96] [--lengths 2,4,6,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.engine import Engine  # noqa: E402
from triton_tlaloc.frontends.drafting import prompt_lookup  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402

DEFAULT_ARTIFACT = ROOT / "artifacts" / "smollm2-f32-spec"

CODE = '''def moving_average(values, window):
    total = 0.0
    out = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
PASSAGE = ("The lighthouse at Punta Roca was built in 1887 from stone quarried on the island "
           "itself. Its lamp burned whale oil until 1912, then kerosene, and since 1956 it has "
           "run on electricity from a cable laid along the seabed. The keeper's house beside "
           "it is now a small museum that opens on weekends from April to October.")
PROMPTS = {
    "code": "Rename the variable `total` to `running_sum` in this Python function and give the "
            "whole function back:\n\n" + CODE,
    "quote": "Here is a passage:\n\n" + PASSAGE + "\n\nQuote the sentence of the passage that "
             "says what the lamp burned, word for word.",
    "chat": "Give me three tips for a first trip to the mountains.",
}


def export_if_missing(path: Path) -> Path:
    if not (path / "tlaloc-serving.json").exists():
        from triton_tlaloc.export import ExportOptions, export_artifact
        from triton_tlaloc.export.checkpoint import smollm2_gguf_path

        export_artifact(smollm2_gguf_path(), path, ExportOptions(
            batch_ladder=(1,), context_ladder=(512,), weight_dtype="f32",
            verify_tokens=(3, 5, 7, 9)))
    return path


def generate(engine, prompt_ids, tokens, k, stop):
    """One greedy generation with up to k drafts a step: (ids, decode seconds, calls after the
    prompt's, drafts checked)."""
    drafted = []

    def drafter(history, n):
        drafts = prompt_lookup(history, n)
        drafted.append(len(drafts))
        return drafts
    result = engine.generate_greedy(prompt_ids, tokens, stop, speculate=k, drafter=drafter)
    return (result.generated_ids, sum(result.decode_ms_per_token) / 1e3,
            len(result.decode_ms_per_token), sum(drafted))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--lengths", default="2,4,6,8")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "spec_bench.json")
    args = ap.parse_args()
    lengths = [0] + [int(x) for x in args.lengths.split(",")]
    from triton_tlaloc.runtime import Runtime

    rt = Runtime(export_if_missing(args.artifact))
    engine = Engine(rt)
    tok = ArtifactTokenizer(args.artifact / "tokenizer")
    stop = tuple(sorted(set(rt.artifact.model.eos_token_ids) | {tok.eos_token_id}
                        - {None}))
    rows = {(kind, k): [] for kind in PROMPTS for k in lengths}
    for run in range(args.runs + 1):  # run 0 warms up
        for kind, text in PROMPTS.items():
            prompt = tok.apply_chat_template([{"role": "user",
                                               "content": f"(request {run}) {text}"}])
            ids = None
            order = lengths if run % 2 else lengths[::-1]
            for k in order:
                got, seconds, calls, drafted = generate(engine, prompt, args.tokens, k, stop)
                assert ids is None or got == ids, f"{kind}, {k} drafts: the ids differ"
                ids = got
                if run:
                    new = len(got) - 1  # the first token comes from the prompt's call
                    rows[(kind, k)].append({
                        "tokens_per_s": new / seconds, "tokens_per_call": new / calls,
                        "acceptance": (new - calls) / drafted if drafted else 0.0})
        print(f"run {run}{' (warm-up)' if run == 0 else ''} done", file=sys.stderr)
    table = []
    for kind in PROMPTS:
        base = statistics.median(r["tokens_per_s"] for r in rows[(kind, 0)])
        for k in lengths:
            med = {m: statistics.median(r[m] for r in rows[(kind, k)])
                   for m in ("tokens_per_s", "tokens_per_call", "acceptance")}
            table.append({"kind": kind, "drafts": k, **med, "ratio": med["tokens_per_s"] / base})
    print(f"\nSmolLM2-135M f32 through the engine, up to {args.tokens} greedy tokens, prompt "
          f"lookup; medians of {args.runs} runs; {os.cpu_count()} cores\n")
    print("| prompt | drafts | tokens/s | ratio | acceptance | tokens a call |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['kind']} | {r['drafts']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | "
              f"{r['acceptance']:.2f} | {r['tokens_per_call']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": args.runs, "tokens": args.tokens, "rows": table},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

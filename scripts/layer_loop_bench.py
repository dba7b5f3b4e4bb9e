#!/usr/bin/env python3
"""The layers unrolled against the layer loop, side by side in one run: the same checkpoint
exported both ways (`--no-layer-loop` and the default), each loaded in a process of its own
from an empty compile cache (every entry compiled before the first call), then: the load's
compile seconds, the process's resident memory, and step times through the engine (no server):
decode at 1, 2 and 4 rows after 100-token prompts, at 1 row after a 3,000-token prompt, and the
prefill of 100 and 3,000 tokens.

Method: the two artifacts alternate for --rounds rounds (the first a warm-up, not counted); a
decode figure is the median of 10 steps after 2 untimed ones, then the median over the counted
rounds; prompts are random ids from a seeded generator, unique per round. Run it on an
otherwise idle machine:

    .venv/bin/python scripts/layer_loop_bench.py [UNROLLED LOOP] [--rounds 3]

(default: artifacts/smollm2-unrolled and artifacts/smollm2, exported by
`tlaloc export smollm2 artifacts/smollm2-unrolled --num-blocks 257 --no-layer-loop` and
`make demo`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, statistics
import numpy as np
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime.memory import release_freed, resident_bytes
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.kv.sequence import Sequence

art, cache, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rt = Runtime(art, cache_dir=cache)
release_freed()
out = {"compile_s": rt.compile_stats.seconds, "rss_gb": resident_bytes() / 1e9}
engine = Engine(rt)
rng = np.random.default_rng(seed)
for rows, prompt in ((1, 100), (2, 100), (4, 100), (1, 3000)):
    seqs = []
    for _ in range(rows):
        seq = Sequence([])
        engine.admit(seq, [int(t) for t in rng.integers(100, 40000, prompt)])
        t0 = time.perf_counter()
        logits = engine.prefill_chunked(seq)
        out[f"prefill {prompt} tokens (ms)"] = (time.perf_counter() - t0) * 1e3
        seq.token_ids.append(int(np.argmax(logits[0])))
        seqs.append(seq)
    steps = []
    for _ in range(12):
        t0 = time.perf_counter()
        logits = engine.decode(seqs)
        steps.append(time.perf_counter() - t0)
        for seq, row in zip(seqs, logits):
            seq.token_ids.append(int(np.argmax(row)))
    out[f"decode {rows} x {prompt} (ms)"] = statistics.median(steps[2:]) * 1e3
    for seq in seqs:
        engine.free(seq)
print("RESULT " + json.dumps(out))
"""


def measure(artifact: Path, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tlaloc-loop-bench-") as cache:
        p = subprocess.run([sys.executable, "-c", CHILD, str(artifact), cache, str(seed)],
                           capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{artifact}: no result\n{p.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("unrolled", nargs="?", type=Path,
                    default=ROOT / "artifacts" / "smollm2-unrolled")
    ap.add_argument("loop", nargs="?", type=Path, default=ROOT / "artifacts" / "smollm2")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the first not counted")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"unrolled": [], "loop": []}
    for r in range(args.rounds):
        for name, path in (("unrolled", args.unrolled), ("loop", args.loop)):
            result = measure(path, seed=1000 + r)
            print(f"round {r} {name}: {json.dumps(result)}", file=sys.stderr, flush=True)
            if r > 0 or args.rounds == 1:
                runs[name].append(result)
    print(f"{'':28} {'unrolled':>10} {'loop':>10} {'loop / unrolled':>16}")
    for key in runs["unrolled"][0]:
        a = statistics.median(x[key] for x in runs["unrolled"])
        b = statistics.median(x[key] for x in runs["loop"])
        print(f"{key:28} {a:10.2f} {b:10.2f} {b / a:15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

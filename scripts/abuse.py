#!/usr/bin/env python3
"""Attack a served SmolLM2 the way an attacker or a careless client would, and print the table:
input, expected, observed, server ready, neighbour ids equal solo (checks/abuse_cases.py holds
the cases; tests/test_hardening.py asserts them), then the faults table against a SmolLM2 with
adapter pools, each case with streams in flight (checks/abuse_faults.py; tests/test_faults.py).
Then, with --soak-seconds, a soak of mixed
clients (sequence model, generate model, OpenAI; good, bad and vanishing) that reports wrong
ids, leaked pages and the serving processes' memory over time. Exit 1 on any failure.

    scripts/abuse.py [--work DIR] [--soak-seconds S] [--clients N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks import abuse_cases as A  # noqa: E402
from checks import abuse_faults as F  # noqa: E402

from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.frontends.client import (InferError, TlalocClient, generate,  # noqa: E402
                                            metric, new_sequence_id, scrape_metrics)

# 64 pages of 16 tokens: room for the soak's clients, and for the cases' full pools.
EXPORT = dict(batch_ladder=(1, 2, 4), context_ladder=(128,), num_blocks=65)
IDLE_S = 120  # Triton's idle timeout: longer than any case holds a sequence idle (the
# neighbour waits out each case: 34 chats outgrowing 64 pages take over 30 s on 2 cores);
# abandoned soak sequences are reclaimed after 2 x 120 + 2 s


def print_table(rows) -> bool:
    head = ("input", "expected", "observed", "ready", "neighbour")
    w = [min(60, max(len(str(r[i])) for r in rows + [head])) for i in range(3)]
    line = f"{head[0]:<{w[0]}}  {head[1]:<{w[1]}}  {head[2]:<{w[2]}}  ready  neighbour  result"
    print("\n" + line + "\n" + "-" * len(line))
    for inp, exp, obs, ready, equal, ok in rows:
        print(f"{inp[:w[0]]:<{w[0]}}  {exp[:w[1]]:<{w[1]}}  {obs[:w[2]]:<{w[2]}}  "
              f"{'yes' if ready else 'NO':<5}  {'equal' if equal else 'DIFFER':<9}  "
              f"{'PASS' if ok else 'FAIL'}")
    passed = sum(r[-1] for r in rows)
    print(f"\n{passed} of {len(rows)} cases passed")
    return passed == len(rows)


def run_cases(t: A.Target) -> bool:
    rows = []
    for inp, expected, fn in A.CASES:
        r = A.run_case(t, fn)
        ok = r["ok"] and r["ready"] and r["neighbour_equal"]
        print(f"{'PASS' if ok else 'FAIL'}  {inp}: {r['observed']}", file=sys.stderr, flush=True)
        rows.append((inp, expected, r["observed"], r["ready"], r["neighbour_equal"], ok))
    return print_table(rows)


def run_fault_cases(work: Path) -> bool:
    """The faults table (checks/abuse_faults.py) on a SmolLM2 with adapter pools, each case
    while its streams run; 'neighbour' is whether the streams gave their solo ids and nothing
    was left changed."""
    art = work / "smollm2-faults"
    if not (art / "tlaloc-serving.json").exists():
        export_artifact(smollm2_gguf_path(), art, ExportOptions(**F.EXPORT))
    t, stop = F.start_fault_target(art, work / "faults")
    rows = []
    try:
        for inp, expected, fn in F.CASES:
            r = F.run_fault_case(t, fn)
            equal = r["streams_equal"] and not r["left"]
            ok = r["ok"] and r["ready"] and equal
            print(f"{'PASS' if ok else 'FAIL'}  {inp}: {r['observed']}", file=sys.stderr,
                  flush=True)
            rows.append((inp, expected, r["observed"], r["ready"], equal, ok))
    finally:
        stop()
    print(f"\nfaults, each with {F.STREAMS} streams in flight:")
    return print_table(rows)


# ------------------------------------------------------------------ the soak

class Soak:
    """`clients` threads until the deadline, by kind (i % 4): the sequence model (greedy ids
    checked against solo runs; 15% vanish without END), the generate model (ids checked; some
    cancelled after 3 responses; some with bad sampling parameters), `tlaloc openai` (text
    checked; some streams dropped mid-way; some malformed bodies), and refused requests (a
    token outside the vocabulary at START, never ENDed; prompts over the context)."""

    PROMPTS = [[1] + [(k * 97 + i * 31) % 4000 + 100 for i in range(n)]
               for k, n in enumerate((5, 9, 14, 20, 27, 33))]
    STEPS = 12

    def __init__(self, t: A.Target):
        self.t = t
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self.abandoned: list[tuple[int, int]] = []  # (id, positions held)
        with TlalocClient(t.server.grpc_url, A.MODEL, "grpc") as c:
            self.solo = [c.generate_greedy(p, self.STEPS, argmax_output=True).generated_ids
                         for p in self.PROMPTS]
        self.solo_text = [generate(t.server.grpc_url, A.GENERATE, input_ids=p, sampling={
            "max_tokens": self.STEPS}).text for p in self.PROMPTS]

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def note(self, where: list, what: str) -> None:
        with self.lock:
            where.append(what)

    def sequence_client(self, rng, protocol):
        k = rng.randrange(len(self.PROMPTS))
        url = self.t.server.http_url if protocol == "http" else self.t.server.grpc_url
        with TlalocClient(url, A.MODEL, protocol) as c:
            sid = new_sequence_id()
            try:
                out = c.request(sid, self.PROMPTS[k], start=True, outputs=("ARGMAX",))
            except InferError as e:
                self.count("sequence refused (full pool)" if "KV pool full" in str(e)
                           else "sequence error")
                c.request(sid, [], end=True, outputs=("ARGMAX",))
                return
            ids = [int(out["ARGMAX"][0])]
            vanish = rng.random() < 0.15
            while len(ids) < self.STEPS:
                if vanish and len(ids) == self.STEPS // 2:
                    self.note(self.abandoned, (sid, len(self.PROMPTS[k]) + len(ids) - 1))
                    self.count("sequence vanished")
                    return
                try:
                    out = c.request(sid, [ids[-1]], outputs=("ARGMAX",))
                except InferError as e:  # a full pool: give up and END
                    self.count("sequence step refused")
                    c.request(sid, [], end=True, outputs=("ARGMAX",))
                    if "KV pool full" not in str(e):
                        self.note(self.errors, str(e)[:100])
                    return
                ids.append(int(out["ARGMAX"][0]))
            c.request(sid, [], end=True, outputs=("ARGMAX",))
            self.count("sequence done")
            if ids != self.solo[k]:
                self.note(self.wrong, f"sequence {self.PROMPTS[k][:3]}: {ids} != {self.solo[k]}")

    def generate_client(self, rng):
        k = rng.randrange(len(self.PROMPTS))
        r = rng.random()
        if r < 0.15:
            g = generate(self.t.server.grpc_url, A.GENERATE, input_ids=self.PROMPTS[k],
                         sampling={"temperature": rng.choice([float("nan"), [], -1, 1e-320])})
            self.count("generate bad (refused)" if g.status == "INVALID_ARGUMENT"
                       else "generate bad NOT REFUSED")
            return
        g = generate(self.t.server.grpc_url, A.GENERATE, input_ids=self.PROMPTS[k],
                     sampling={"max_tokens": self.STEPS, "ignore_eos": True},
                     cancel_after=3 if r < 0.3 else None)
        if r < 0.3:
            self.count("generate cancelled")
        elif g.status == "UNAVAILABLE":
            self.count("generate refused (full pool)")
        elif g.error is not None:
            self.note(self.errors, f"generate: {g.error[:100]}")
        else:
            self.count("generate done")
            if g.token_ids != self.solo[k]:
                self.note(self.wrong, f"generate {self.PROMPTS[k][:3]}: {g.token_ids}")

    def openai_client(self, rng):
        k = rng.randrange(len(self.PROMPTS))
        r = rng.random()
        if r < 0.15:
            status, _, _ = A.openai_request(self.t, "/completions", raw=b'{"model": ')
            self.count(f"openai malformed ({status})")
            return
        if r < 0.3:
            try:
                A._open_stream(self.t, max_tokens=40).close()
                self.count("openai stream dropped")
            except RuntimeError:
                self.count("openai stream refused")
            return
        status, _, text = A.openai_request(self.t, "/completions", A.completion(
            self.PROMPTS[k], max_tokens=self.STEPS))
        if status in (429, 503):
            self.count(f"openai {status}")
            return
        if status != 200:
            self.note(self.errors, f"openai {status}: {text[:100]}")
            return
        self.count("openai done")
        got = json.loads(text)["choices"][0]["text"]
        if got != self.solo_text[k]:
            self.note(self.wrong, f"openai {self.PROMPTS[k][:3]}: {got!r}")

    def bad_client(self, rng):
        if rng.random() < 0.5:
            with TlalocClient(self.t.server.grpc_url, A.MODEL, "grpc") as c:
                try:
                    c.request(new_sequence_id(), [1, 10**9], start=True, outputs=("ARGMAX",))
                except InferError:
                    self.count("bad START refused, never ENDed")
        else:
            status, _, _ = A.openai_request(self.t, "/completions", A.completion(
                list(range(1, self.t.max_context + 10))))
            self.count(f"openai over the context ({status})")

    def worker(self, i: int, deadline: float):
        rng = random.Random(2000 + i)
        kind = i % 4
        while time.monotonic() < deadline:
            try:
                if kind == 0:
                    self.sequence_client(rng, ("http", "grpc")[(i // 4) % 2])
                elif kind == 1:
                    self.generate_client(rng)
                elif kind == 2:
                    self.openai_client(rng)
                else:
                    self.bad_client(rng)
                    time.sleep(0.05)
            except Exception as e:
                self.note(self.errors, f"{type(e).__name__}: {str(e)[:100]}")

    def run(self, seconds: float, clients: int, sample_s: float = 10.0) -> bool:
        import psutil

        server = psutil.Process(self.t.server.proc.pid)
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self.worker, args=(i, deadline), daemon=True)
                   for i in range(clients)]
        for th in threads:
            th.start()
        t0, samples = time.monotonic(), []
        while any(th.is_alive() for th in threads):
            procs = [server] + server.children(recursive=True)
            rss = {_process_name(p): p.memory_info().rss / 2**20 for p in procs if p.is_running()}
            samples.append((time.monotonic() - t0, rss))
            print(f"  t={samples[-1][0]:5.0f} s  " + "  ".join(
                f"{k} {v:.0f} MiB" for k, v in rss.items()), file=sys.stderr, flush=True)
            time.sleep(sample_s)
        for th in threads:
            th.join()
        return self.report(samples)

    def report(self, samples) -> bool:
        log = self.t.server.log_text()
        left = [(sid, n) for sid, n in self.abandoned if f"reclaimed sequence {sid}:" not in log]
        expect = sum(-(-n // self.t.block_size) for _, n in left)
        m = scrape_metrics(self.t.server.metrics_url, settle_s=0.6)
        used = metric(m, "tlaloc_kv_pages_used", model=A.MODEL)
        print("\nRSS over time (MiB):")
        names = sorted({k for _, rss in samples for k in rss})
        print("   t (s)  " + "  ".join(f"{n:>22}" for n in names))
        for t, rss in samples:
            print(f"  {t:6.0f}  " + "  ".join(f"{rss.get(n, 0):22.0f}" for n in names))
        after_minute = [rss for t, rss in samples if t >= 60]
        growth = {n: max(r.get(n, 0) for r in after_minute) - min(r.get(n, 0) for r in
                                                                 after_minute)
                  for n in names} if len(after_minute) > 1 else {}
        print("\ncounts:", dict(sorted(self.counts.items())))
        print(f"wrong ids: {len(self.wrong)} {self.wrong[:3]}")
        print(f"errors: {len(self.errors)} {self.errors[:3]}")
        print(f"pages used at the end: {used:.0f}; held by vanished sequences not yet "
              f"reclaimed: {expect} ({len(left)} of {len(self.abandoned)})")
        print("RSS growth after the first minute (MiB):",
              {n: round(g, 1) for n, g in growth.items()})
        flat = all(g < 64 for g in growth.values())
        return not self.wrong and not self.errors and used == expect and flat


def _process_name(p) -> str:
    cmd = " ".join(p.cmdline())
    if "triton_python_backend_stub" in cmd:
        model = cmd.split("/1/model.py")[0].rsplit("/", 1)[-1] if "/1/model.py" in cmd else "?"
        return f"stub {model}"
    return p.name()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "abuse")
    ap.add_argument("--soak-seconds", type=float, default=0.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--skip-cases", action="store_true")
    args = ap.parse_args()
    art = args.work / "smollm2"
    if not (art / "tlaloc-serving.json").exists():
        export_artifact(smollm2_gguf_path(), art, ExportOptions(**EXPORT))
    t, stop = A.start_target(art, args.work / "repo", max_concurrent=8, idle_s=IDLE_S)
    try:
        ok = True if args.skip_cases else run_cases(t)
        if args.soak_seconds:
            print(f"\nsoak: {args.soak_seconds:.0f} s, {args.clients} clients", flush=True)
            ok = Soak(t).run(args.soak_seconds, args.clients) and ok
    finally:
        stop()
    if not args.skip_cases:
        ok = run_fault_cases(args.work) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Checks of the host tier on a real tritonserver, written once: tests/test_host_tier_server.py
asserts them and scripts/verify.py tabulates them. Each returns or yields (what was observed,
whether it passed). `model` has the host tier; `control` is the same artifact served with
host_kv_bytes 0 (`tlaloc repository --host-kv-bytes 0`): today's refusals.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np

from checks.sequence_checks import new_sequence_id
from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, InferError, TlalocClient, metric,
                                            scrape_metrics)

HOST_COUNTERS = (("swapped out", "tlaloc_swap_bytes_total", {"direction": "out"}),
                 ("swapped in", "tlaloc_swap_bytes_total", {"direction": "in"}),
                 ("preemptions", "tlaloc_preemptions_total", {}),
                 ("refusals", "tlaloc_refusals_total", {"reason": "pages"}))


def host_counters(metrics_url: str, model: str) -> dict[str, float]:
    m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    return {k: metric(m, name, model=model, **labels) for k, name, labels in HOST_COUNTERS}


def _delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def chat_plans(seed: int, sessions: int, turns: int, prompt=(8, 20), user=(3, 8),
               vocab=(10, 250)) -> list[list[list[int]]]:
    """Each session's turns: its first prompt, then each turn's user tokens (all unique)."""
    rng = random.Random(seed)
    return [[[rng.randrange(*vocab) for _ in range(rng.randint(*(prompt if t == 0 else user)))]
             for t in range(turns)] for _ in range(sessions)]


def run_session(c: TlalocClient, plan: list[list[int]], new_tokens: int,
                waits: list[float] = (), end: bool = True, seq_id=None) -> list[int]:
    """One chat on one sequence id: the first turn STARTs with plan[0]; each turn takes
    `new_tokens` greedy ids (a decode request each, fed its own argmax), then the next turn's
    user tokens go as one request (a prefill continuation), after waits[t] seconds. The last
    request is an END (when `end`). Returns every generated id."""
    sid = new_sequence_id() if seq_id is None else seq_id
    ids = []
    for t, tokens in enumerate(plan):
        if t and waits:
            time.sleep(waits[t - 1])
        logits, _ = c.infer(sid, tokens, start=t == 0)
        for k in range(new_tokens):
            ids.append(int(np.argmax(logits)))
            if k < new_tokens - 1:
                logits, _ = c.infer(sid, [ids[-1]])
    if end:
        c.infer(sid, [], end=True)
    return ids


def _parallel(fn, n: int) -> None:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def chat_sessions(url, protocol, model, plans, new_tokens, max_wait, seed) -> dict:
    """Every session at once, each waiting a random 0..max_wait s between its turns: the ids
    of each (None when refused) and the errors."""
    got, errors, lock = [None] * len(plans), [], threading.Lock()

    def session(i):
        rng = random.Random(seed * 1000 + i)
        waits = [rng.uniform(0, max_wait) for _ in plans[i]]
        sid = new_sequence_id()
        with TlalocClient(url, model, protocol) as c:
            try:
                got[i] = run_session(c, plans[i], new_tokens, waits, seq_id=sid)
            except InferError as e:
                with lock:
                    errors.append(str(e))
                try:
                    c.infer(sid, [], end=True)
                except InferError:
                    pass
    _parallel(session, len(plans))
    return {"ids": got, "errors": errors}


def check_chat_pressure(url, protocol, metrics_url, model, control, sessions=16, turns=3,
                        new_tokens=6, max_wait=3.0, seed=0, **plan):
    """`sessions` chats at once on a pool that holds a few of them, each waiting 0..max_wait s
    between turns and never ending before its last: with the host tier no refusal and every
    session's ids equal its solo run (the sessions one at a time on `control`), swaps counted;
    yields ("swapped", result). Then the same script on `control`: refused; ("control", ...)."""
    plans = chat_plans(seed, sessions, turns, **plan)
    with TlalocClient(url, control, protocol) as c:
        solo = [run_session(c, p, new_tokens) for p in plans]
    before = host_counters(metrics_url, model)
    t0 = time.monotonic()
    r = chat_sessions(url, protocol, model, plans, new_tokens, max_wait, seed)
    seconds = time.monotonic() - t0
    d = _delta(before, host_counters(metrics_url, model))
    same = sum(g == s for g, s in zip(r["ids"], solo))
    yield "swapped", (f"{same}/{sessions} sessions with their solo ids, {len(r['errors'])} "
                      f"refused {r['errors'][:1]}; swapped out {d['swapped out'] / 2**20:.1f} "
                      f"MiB, in {d['swapped in'] / 2**20:.1f} MiB, {d['preemptions']:.0f} "
                      f"preemptions, in {seconds:.1f} s",
                      same == sessions and not r["errors"] and d["swapped out"] > 0
                      and d["swapped in"] > 0 and d["refusals"] == 0)
    r = chat_sessions(url, protocol, control, plans, new_tokens, max_wait, seed)
    refused = [e for e in r["errors"] if "KV pool full" in e]
    wrong = sum(g is not None and g != s for g, s in zip(r["ids"], solo))
    yield "control", (f"host_kv_bytes 0: {len(refused)} of {sessions} sessions refused for "
                      f"pages, {len(r['errors']) - len(refused)} other errors, {wrong} with "
                      f"other ids", bool(refused) and len(refused) == len(r["errors"])
                      and not wrong)


def check_preemption(url, protocol, metrics_url, model, n=6, prompt_len=10, new_tokens=50,
                     seed=0):
    """`n` sequences decoding together from `prompt_len`-token prompts to `new_tokens` each,
    whose growth overruns the pool mid-generation: no refusal, every sequence's ids equal its
    solo run, preemptions counted."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 250) for _ in range(prompt_len)] for _ in range(n)]
    with TlalocClient(url, model, protocol) as c:
        solo = [c.generate_greedy(p, new_tokens, argmax_output=True).generated_ids
                for p in prompts]
    before = host_counters(metrics_url, model)
    got, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def run(i):
        with TlalocClient(url, model, protocol) as c:
            barrier.wait()
            try:
                got[i] = c.generate_greedy(prompts[i], new_tokens,
                                           argmax_output=True).generated_ids
            except InferError as e:
                errors.append(str(e))
    t0 = time.monotonic()
    _parallel(run, n)
    seconds = time.monotonic() - t0
    d = _delta(before, host_counters(metrics_url, model))
    same = sum(g == s for g, s in zip(got, solo))
    return (f"{same}/{n} with their solo ids, {len(errors)} refused {errors[:1]}; "
            f"{d['preemptions']:.0f} preemptions, swapped out {d['swapped out'] / 2**20:.2f} MiB "
            f"and in {d['swapped in'] / 2**20:.2f} MiB, in {seconds:.1f} s",
            same == n and not errors and d["preemptions"] > 0 and d["refusals"] == 0)


def check_swap_soak(url, protocol, metrics_url, model, seconds, reclaim_after_s,
                    fill=(4, 64), clients=12, seed=0):
    """`clients` run chat sessions for `seconds` on a small pool: some end, some vanish (no
    END: Triton times them out), some vanish while swapped out. Then, past the reclamation
    rule, `fill` (sequences, tokens) STARTs that need the whole pool reclaim what Triton ended
    and END. Held pages, host bytes, swapped and held sequences must all be back to 0 (cached
    pages counted apart); no request refused or wrong."""
    deadline = time.monotonic() + seconds
    counts = {"ended": 0, "vanished": 0, "errors": []}
    lock = threading.Lock()

    def worker(i):
        rng = random.Random(seed * 1000 + i)
        with TlalocClient(url, model, protocol) as c:
            while time.monotonic() < deadline:
                plan = chat_plans(rng.randrange(1 << 30), 1, rng.randint(1, 3))[0]
                vanish = rng.random() < 0.3
                try:
                    run_session(c, plan, rng.randint(2, 8),
                                [rng.uniform(0, 1.5) for _ in plan], end=not vanish)
                except InferError as e:
                    with lock:
                        counts["errors"].append(str(e)[:160])
                with lock:
                    counts["vanished" if vanish else "ended"] += 1
    _parallel(worker, clients)
    time.sleep(reclaim_after_s + 1.0)  # swapped-out sequences Triton ended are swept
    m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    swept = metric(m, "tlaloc_host_kv_bytes", model=model)
    n, tokens = fill
    rng = random.Random(seed)
    with TlalocClient(url, model, protocol) as c:
        ids = [new_sequence_id() for _ in range(n)]
        for sid in ids:  # the whole pool: every sequence Triton ended is reclaimed
            c.infer(sid, [rng.randrange(10, 250) for _ in range(tokens)], start=True)
        for sid in ids:
            c.infer(sid, [], end=True)
    m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    left = {"pages held": metric(m, "tlaloc_kv_pages_used", model=model, pool="full"),
            "host bytes": metric(m, "tlaloc_host_kv_bytes", model=model),
            "swapped": metric(m, "tlaloc_sequences_swapped", model=model),
            "sequences held": metric(m, "tlaloc_sequences_held", model=model)}
    cached = metric(m, "tlaloc_kv_pages_cached", model=model, pool="full")
    host_cached = metric(m, "tlaloc_host_cached_kv_bytes", model=model)
    swaps = metric(m, "tlaloc_swap_bytes_total", model=model, direction="out")
    return (f"{counts['ended']} sessions ended, {counts['vanished']} vanished, "
            f"{len(counts['errors'])} errors {counts['errors'][:1]}; "
            f"{swaps / 2**20:.1f} MiB swapped out; host bytes after the rule {swept:.0f}; "
            f"at the end " + ", ".join(f"{k} {v:.0f}" for k, v in left.items())
            + f" ({cached:.0f} pages cached, {host_cached / 2**20:.2f} MiB of evicted blocks "
            f"on the host)",
            not counts["errors"] and counts["vanished"] > 0 and swaps > 0 and swept == 0
            and all(v == 0 for v in left.values()))


def check_host_prefix(url, protocol, metrics_url, model, control, fill, system_len=40,
                      new_tokens=8, seed=0):
    """A system prompt's blocks, evicted from the device by `fill` (sequences, tokens) STARTs
    that take the whole pool, are found on the host tier by the next prompt beginning with it
    and written back instead of computed (tlaloc_prefix_cache_host_hits_total grows); both
    prompts get the ids `control` gives them."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 250) for _ in range(system_len)]
    prompts = [system + [rng.randrange(10, 250) for _ in range(5)] for _ in range(2)]
    with TlalocClient(url, control, protocol) as c:
        solo = [c.generate_greedy(p, new_tokens, argmax_output=True).generated_ids
                for p in prompts]

    def host_hits():
        m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
        return (metric(m, "tlaloc_prefix_cache_host_hits_total", model=model),
                metric(m, "tlaloc_host_cached_kv_bytes", model=model))
    with TlalocClient(url, model, protocol) as c:
        first = c.generate_greedy(prompts[0], new_tokens, argmax_output=True).generated_ids
        n, tokens = fill
        ids = [new_sequence_id() for _ in range(n)]
        for sid in ids:  # the whole pool: the system prompt's blocks are evicted
            c.infer(sid, [rng.randrange(10, 250) for _ in range(tokens)], start=True)
        for sid in ids:
            c.infer(sid, [], end=True)
        hits, cached = host_hits()
        second = c.generate_greedy(prompts[1], new_tokens, argmax_output=True).generated_ids
        hits = host_hits()[0] - hits
    return (f"{hits:.0f} of the {system_len} system prompt tokens written back from the "
            f"host ({cached / 2**20:.2f} MiB of evicted blocks there); ids "
            f"{'equal' if [first, second] == solo else 'differ from'} {control}'s",
            [first, second] == solo and 0 < hits <= system_len)

"""Checks of KV reuse on a real tritonserver, written once: tests/test_kv_reuse_server.py
asserts them and scripts/verify.py tabulates them. Each returns (what was observed, whether it
passed). `model` reuses prefixes; `cold` is the same artifact served with prefix_reuse false
(`tlaloc repository --no-prefix-reuse`), the reference every reused run is compared with.
"""

from __future__ import annotations

import random
import threading
import time

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, InferError, TlalocClient,
                                            full_pool_pages, generate, metric,
                                            reuse_counters, scrape_metrics)


def unique_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]


class Counters:
    """The reuse counters of some models, scraped before and after."""

    def __init__(self, metrics_url: str):
        self.url = metrics_url
        self.before = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)

    def delta(self, model: str) -> dict[str, float]:
        after = reuse_counters(scrape_metrics(self.url, settle_s=METRICS_SETTLE_S), model)
        before = reuse_counters(self.before, model)
        return {k: v - before[k] for k, v in after.items()}


def check_shared_prefix(url, protocol, metrics_url, model, cold, seed, users=4, prefix_blocks=3,
                        block_size=8, steps=8):
    """`users` prompts sharing a prefix of `prefix_blocks` blocks, each with a question of its
    own: the same greedy ids with reuse as without, and users 2.. reuse the whole prefix."""
    rng = random.Random(seed)
    prefix = unique_tokens(rng, prefix_blocks * block_size)
    prompts = [prefix + unique_tokens(rng, 5) for _ in range(users)]
    counters = Counters(metrics_url)
    got = {}
    for name in (model, cold):
        with TlalocClient(url, name, protocol) as c:
            got[name] = [c.generate_greedy(p, steps).generated_ids for p in prompts]
    warm, off = counters.delta(model), counters.delta(cold)
    want = (users - 1) * len(prefix)
    ok = (got[model] == got[cold] and warm["hits"] >= want and off["hits"] == 0
          and off["queries"] == 0)
    return (f"ids {'equal' if got[model] == got[cold] else 'DIFFER'}; {warm['hits']:.0f} of "
            f"{warm['queries']:.0f} prompt tokens reused (want >= {want}), none without reuse",
            ok)


def check_cache_salts(url, protocol, metrics_url, model, seed, block_size=8):
    """A prompt under salt A, then B, then A again: B reuses nothing A cached, the second A
    reuses its blocks (and with a host tier, a copy of the first A's last block: all but its
    last token)."""
    rng = random.Random(seed)
    prompt = unique_tokens(rng, 3 * block_size + 2)
    hits = []
    with TlalocClient(url, model, protocol) as c:
        for salt in ("tenant-a", "tenant-b", "tenant-a"):
            counters = Counters(metrics_url)
            c.generate_greedy(prompt + [salt.count("b") + 3], 1, cache_salt=salt)
            hits.append(counters.delta(model)["hits"])
    ok = hits[0] == 0 and hits[1] == 0 and hits[2] in (3 * block_size, len(prompt))
    return f"tokens reused under A, B, A: {hits}", ok


def check_binary_salts(url, protocol, metrics_url, model, seed, block_size=8):
    """Salts as the CACHE_SALT input's bytes, which carry a NUL whole: b'g\\0one', b'g\\0two'
    and b'g' reuse nothing of each other, and b'g\\0one' again reuses its first run's blocks;
    the parameter salt 'g' is the input's b'g' (the same tenant)."""
    rng = random.Random(seed)
    prompt = unique_tokens(rng, 3 * block_size + 2)
    hits = []
    with TlalocClient(url, model, protocol) as c:
        for salt in (b"g\0one", b"g\0two", b"g", b"g\0one", "g"):
            counters = Counters(metrics_url)
            c.generate_greedy(prompt + [7], 1, cache_salt=salt)
            hits.append(counters.delta(model)["hits"])
    whole = (3 * block_size, len(prompt))
    ok = hits[:3] == [0, 0, 0] and hits[3] in whole and hits[4] in whole
    return f"tokens reused under b'g\\0one', b'g\\0two', b'g', b'g\\0one', 'g': {hits}", ok


def check_control_character_salts(url, protocol, model):
    """Salts that differ only after a NUL ('g\\0one', 'g\\0two') would reach the sequence model
    as one salt (Triton's string parameters end at a NUL) and share cached KV: TlalocClient
    refuses them by name before sending, and the generate model, which sees its JSON whole,
    refuses them INVALID_ARGUMENT."""
    said = []
    with TlalocClient(url, model, protocol) as c:
        for salt in ("g\0one", "g\0two"):
            try:
                c.generate_greedy([5, 6, 7], 1, cache_salt=salt)
            except ValueError as e:
                said.append(str(e))
    got = None  # the generate model is a gRPC stream
    if protocol == "grpc":
        got = generate(url, f"{model}_generate", input_ids=[5, 6, 7],
                       sampling={"max_tokens": 1, "cache_salt": "g\0one"})
    client_ok = len(said) == 2 and all("U+0000" in s for s in said)
    generate_ok = got is None or (got.status == "INVALID_ARGUMENT" and "U+0000" in got.error)
    return (f"client: {said}; generate model: "
            f"{None if got is None else (got.status, got.error)}"), client_ok and generate_ok


def check_sequence_chat(url, protocol, metrics_url, model, cold, seed, turns=3, new_tokens=7,
                        answer=6, first=13):
    """A chat on the sequence models: each turn STARTs with the whole history (earlier prompts
    and answers) and a new message, steps greedily and ENDs. The same ids with reuse as
    without; every turn after the first continues the sequence its previous turn ended (a
    ring's or a state's model included)."""
    rng = random.Random(seed)
    counters = Counters(metrics_url)
    history, same = unique_tokens(rng, first), True
    with TlalocClient(url, model, protocol) as warm, TlalocClient(url, cold, protocol) as off:
        for _ in range(turns):
            history += unique_tokens(rng, new_tokens)
            ids = [c.generate_greedy(history, answer, argmax_output=True).generated_ids
                   for c in (warm, off)]
            same &= ids[0] == ids[1]
            history += ids[0]
    got = counters.delta(model)
    ok = same and got["continued"] == turns - 1
    return (f"{turns} turns, ids {'equal' if same else 'DIFFER'}; {got['continued']:.0f} "
            f"continued, {got['hits']:.0f} tokens reused", ok)


def check_generate_chat(grpc_url, metrics_url, model, cold, seed, turns=4, new_tokens=9,
                        answer=6, cache_salt=None):
    """A chat through the generate models: each turn's prompt is the history (previous prompts
    and answers) and a new message; the same ids with reuse as without, and every turn after
    the first continues the sequence its previous turn ended."""
    rng = random.Random(seed)
    counters = Counters(metrics_url)
    history, same = unique_tokens(rng, 11), True
    sampling = {"max_tokens": answer, "ignore_eos": True,
                **({"cache_salt": cache_salt} if cache_salt else {})}
    for _ in range(turns):
        history += unique_tokens(rng, new_tokens)
        ids = {name: generate(grpc_url, f"{name}_generate", input_ids=history,
                              sampling=sampling).token_ids for name in (model, cold)}
        same &= ids[model] == ids[cold]
        history += ids[model]
    warm, off = counters.delta(model), counters.delta(cold)
    ok = same and warm["continued"] == turns - 1 and off["continued"] == 0
    return (f"{turns} turns, ids {'equal' if same else 'DIFFER'}; {warm['continued']:.0f} "
            f"turns continued, {warm['hits']:.0f} tokens reused", ok)


def check_openai_chat_turns(grpc_url, metrics_url, model, cold, questions, max_tokens=8):
    """A chat through `tlaloc openai` (the openai package): each turn's reply with reuse equals
    the reply without, and the later turns reuse their history."""
    import openai

    from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread

    base_url, stop = serve_in_thread(grpc_url, {
        name: ServedModel.discover(grpc_url, name) for name in (model, cold)})
    counters = Counters(metrics_url)
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        replies = {model: [], cold: []}
        for name in (model, cold):
            messages = []
            for q in questions:
                messages.append({"role": "user", "content": q})
                chat = client.chat.completions.create(model=name, messages=messages,
                                                      temperature=0, max_tokens=max_tokens)
                replies[name].append(chat.choices[0].message.content)
                messages.append({"role": "assistant", "content": replies[name][-1]})
    finally:
        stop()
    warm = counters.delta(model)
    same = replies[model] == replies[cold]
    ok = same and warm["hits"] > 0
    return (f"{len(questions)} turns, replies {'equal' if same else 'DIFFER'}; "
            f"{warm['hits']:.0f} of {warm['queries']:.0f} prompt tokens reused", ok)


def check_pressure(url, protocol, metrics_url, model, solo, prompts, seconds, capacity,
                   steps=(4, 12), users=12, seed=0):
    """`users` clients cycle START, greedy steps, END for `seconds` on a small pool, prompts
    sharing a prefix: every sequence's ids equal its solo run (`solo[i]` for prompts[i], a
    prefix of it when it runs fewer steps; a refusal for want of pages is retried, never
    a wrong id), and at the end no page is held and held + cached + free == capacity."""
    wrong, done, refused, errors = [], [0], [0], []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(i):
        rng = random.Random(seed * 1000 + i)
        with TlalocClient(url, model, protocol) as c:
            while time.monotonic() < deadline:
                k = rng.randrange(len(prompts))
                n = rng.randint(*steps)
                try:
                    got = c.generate_greedy(prompts[k], n, argmax_output=True).generated_ids
                except InferError as e:
                    with lock:
                        if "KV pool full" in str(e):
                            refused[0] += 1
                        else:
                            errors.append(str(e)[:120])
                    time.sleep(0.05)
                    continue
                with lock:
                    done[0] += 1
                    if got != solo[k][:n]:
                        wrong.append((k, n))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    pages = full_pool_pages(m, model)
    total = pages["used"] + pages["cached"] + pages["free"]
    evicted = metric(m, "tlaloc_kv_evictions_total", model=model, what="pages")
    ok = (not wrong and not errors and done[0] > users and pages["used"] == 0
          and total == capacity)
    return (f"{done[0]} sequences, {len(wrong)} with other ids, {refused[0]} refused for pages "
            f"(retried), {len(errors)} other errors {errors[:1]}; {evicted:.0f} cached pages "
            f"evicted; at the end pages held "
            f"{pages['used']:.0f}, cached {pages['cached']:.0f}, free {pages['free']:.0f} of "
            f"{capacity}", ok)


def solo_ids(url, protocol, model, prompts, steps) -> list[list[int]]:
    with TlalocClient(url, model, protocol) as c:
        return [c.generate_greedy(p, steps, argmax_output=True).generated_ids for p in prompts]

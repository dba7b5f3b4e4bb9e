"""Checks of language models served by a real tritonserver, written once: scripts/verify.py
tabulates them and tests/test_server.py and tests/test_hybrid_server.py assert them. Each check
takes a client, a URL or the server, and the model's name, and returns (what was observed,
whether it passed); a scenario with several results (reclamation, the soak) yields
(key, (observed, ok)) as each result is known.

The checks compare ids with a reference run: transformers' greedy ids (checks/oracle.py), or the
same prompt's solo run. The page policy, batching and state slots they exercise are described
in docs/design.md.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
import uuid

import numpy as np

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, InferError, TlalocClient, generate,
                                            generate_http, metric, new_sequence_id, scrape_metrics)
from triton_tlaloc.artifact.loading import load_artifact

PROTOCOLS = ("http", "grpc")
TINY_PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
PLACEHOLDER = 7  # the small model's image_token_id

# Requests refused inside a held sequence, (tokens, code, message), on the small model (a
# vocabulary of 256, contexts 32 and 64, PLACEHOLDER as its image_token_id).
SEQUENCE_REFUSALS = (
    ([5, 256], "INVALID_ARG", "token id 256 is outside the vocabulary [0, 256)"),
    ([PLACEHOLDER], "INVALID_ARG", "token id 7 is the checkpoint's image_token_id placeholder"),
    ([], "INVALID_ARG", "TOKENS is empty"),
    (list(range(10, 70)), "INVALID_ARG", "65 positions would exceed the largest context 64"),
)
NEGATIVE_ID_REFUSAL = ([-3], "INVALID_ARG", "token id -3 is outside the vocabulary")
# STARTs refused as INVALID_ARG, (prompt, message).
START_REFUSALS = ((list(range(10, 75)), "largest context 64"),)
PLACEHOLDER_START_REFUSAL = ([1, PLACEHOLDER], "image_token_id")


# ---------------------------------------------------------------- helpers

def url_of(server, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


def refusal(client, seq_id, tokens, **kw) -> InferError | None:
    """The error a request gets, or None when it was accepted."""
    try:
        client.infer(seq_id, tokens, **kw)
    except InferError as e:
        return e
    return None


def code_of(err: InferError | None, protocol: str) -> str:
    """INVALID_ARG, UNAVAILABLE, "accepted" (no error) or "other", read from the error's status
    alone: a message may hold a sequence id whose digits contain 400 or 503."""
    if err is None:
        return "accepted"
    for name, http, grpc in (("INVALID_ARG", "400", "INVALID_ARGUMENT"),
                             ("UNAVAILABLE", "503", "UNAVAILABLE")):
        if (http if protocol == "http" else grpc) in str(err.status):
            return name
    return "other"


def describe(err: InferError | None) -> str:
    return "accepted" if err is None else f"{err.status} {err}"


def continue_greedy(client, seq_id, logits, steps) -> list[int]:
    """`steps` greedy ids of a held sequence whose last response gave `logits`."""
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        logits, _ = client.infer(seq_id, [ids[-1]])
    return ids


def run_parallel(fn, n: int, timeout: float | None = 300.0) -> None:
    """fn(0) .. fn(n - 1) on n threads at once; returns when all are done, raising the first
    exception a thread raised."""
    errors = []

    def run(i):
        try:
            fn(i)
        except Exception as e:  # raised below, on the caller's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]


def greedy_together(url, protocol, model, prompts, steps,
                    cache_salt: str | None = None) -> list[list[int]]:
    """Each prompt's `steps` greedy ids, from clients that each connect and then wait for the
    others before sending their prompt (with `cache_salt`: sharing no cached KV with prompts
    of another salt)."""
    got = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts), timeout=120)

    def run(i):
        with TlalocClient(url, model, protocol) as c:
            barrier.wait()
            got[i] = c.generate_greedy(prompts[i], steps,
                                       cache_salt=cache_salt).generated_ids
    run_parallel(run, len(prompts))
    return got


def solo_runs(url, protocol, model, prompts, steps) -> list[list[int]]:
    with TlalocClient(url, model, protocol) as c:
        return [c.generate_greedy(p, steps).generated_ids for p in prompts]


def metrics_delta(metrics_url: str, fn):
    """Run fn(); returns (its result, a function giving a tlaloc_/nv_ metric's change)."""
    before = scrape_metrics(metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
    result = fn()
    after = scrape_metrics(metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
    return result, lambda name, **labels: metric(after, name, **labels) - metric(before, name,
                                                                                  **labels)


def assert_check(result) -> None:
    """For the tests: a check's (observed, ok), printed, and failed when not ok."""
    observed, ok = result
    print(observed)
    assert ok, observed


class Conditions:
    """The named conditions of a check: result() passes when every one held."""

    def __init__(self):
        self.failed: list[str] = []

    def __call__(self, ok, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return bool(ok)

    def result(self, summary: str) -> tuple[str, bool]:
        if self.failed:
            return "failed: " + "; ".join(self.failed), False
        return summary, True


# ---------------------------------------------------------------- ids against a reference

def check_greedy_ids(client, prompt, want, decode=None):
    """len(want) greedy ids of `prompt` equal `want` (transformers'); with `decode` (ids ->
    text) the observation adds ms/token and the text."""
    g = client.generate_greedy(prompt, len(want))
    same = sum(a == b for a, b in zip(g.generated_ids, want))
    observed = f"{same}/{len(want)} equal"
    if decode is not None:
        observed += f", {g.ms_per_token:.1f} ms/token, {decode(g.generated_ids)[:40]!r}"
    return observed, g.generated_ids == want


def check_negative_control(client, prompt, want):
    """A model exported wrong (rope theta x4): the greedy-id check must fail it."""
    observed, ok = check_greedy_ids(client, prompt, want)
    return f"{observed}: the id check fails it", not ok


def check_alone_and_batched(url, protocol, model, prompts, want, steps, alone=True):
    """prompts[0] alone (with `alone`), then every prompt from clients started together:
    each one's greedy ids equal `want` (transformers')."""
    observed, ok = [], True
    if alone:
        with TlalocClient(url, model, protocol) as c:
            ok_alone = c.generate_greedy(prompts[0], steps).generated_ids == want[0]
        observed.append(f"alone {'equal' if ok_alone else 'differs'}")
        ok = ok_alone
    got = greedy_together(url, protocol, model, prompts, steps)
    equal = sum(g == w for g, w in zip(got, want))
    observed.append(f"batched {equal}/{len(prompts)} equal")
    return "; ".join(observed), ok and equal == len(prompts)


def check_concurrent_solo(url, protocol, model, prompts, steps, solo=None):
    """Sequences started together each equal their solo run (the server's, unless `solo`)."""
    solo = solo if solo is not None else solo_runs(url, protocol, model, prompts, steps)
    got = greedy_together(url, protocol, model, prompts, steps)
    same = sum(g == s for g, s in zip(got, solo))
    return f"{same}/{len(prompts)} equal to their solo runs", same == len(prompts)


def random_drafter(seed: int, vocab: int = 256):
    """A drafter that guesses at random: its drafts are almost all rejected."""
    rng = random.Random(seed)
    return lambda history, k: [rng.randrange(vocab) for _ in range(k)]


def known_drafter(prompt, want, right: int):
    """A drafter that knows the greedy ids `want` of `prompt`: its first `right` drafts of a
    step are right, the rest wrong (a tiny random model never repeats itself, so prompt lookup
    rarely guesses right there; this one is accepted as often as it says)."""
    def draft(history, k):
        true = want[len(history) - len(prompt):][:k]
        return true[:right] + [(t + 1) % 256 for t in true[right:]]
    return draft


def check_speculation(url, protocol, model, prompt, want, lengths=range(1, 9), others=()):
    """Greedy ids with drafts verified by the server equal `want` (greedy ids without): with
    prompt lookup at each of `lengths` drafts a step, with drafts right twice then wrong (3 ids
    a call: fewer calls, or the equality would prove nothing), with random drafts, and while
    `others` (prompts) decode without drafts at the same time (each equal to its solo run)."""
    cond = Conditions()
    with TlalocClient(url, model, protocol) as c:
        for k in lengths:
            g = c.generate_greedy(prompt, len(want), speculate=k)
            cond(g.generated_ids == want, f"{k} drafts a step: {g.generated_ids} != {want}")
        g = c.generate_greedy(prompt, len(want), speculate=4,
                              drafter=known_drafter(prompt, want, 2))
        cond(g.generated_ids == want, "drafts right twice a step: the ids differ")
        calls = len(g.step_ms) + 1
        cond(calls <= 2 + (len(want) - 1) // 3, f"{calls} calls for {len(want)} ids")
        g = c.generate_greedy(prompt, len(want), speculate=4, drafter=random_drafter(0))
        cond(g.generated_ids == want, "random drafts: the ids differ")
        solo = [c.generate_greedy(p, len(want)).generated_ids for p in others]
    if others:
        got = [None] * (1 + len(others))
        barrier = threading.Barrier(len(got), timeout=120)

        def run(i):
            with TlalocClient(url, model, protocol) as c:
                barrier.wait()
                got[i] = c.generate_greedy(
                    ([prompt] + list(others))[i], len(want), speculate=4 if i == 0 else 0,
                    drafter=known_drafter(prompt, want, 2)).generated_ids
        run_parallel(run, len(got))
        cond(got[0] == want, "drafting beside other sequences: the ids differ")
        cond(got[1:] == solo, "sequences decoding beside a drafting one differ from solo")
    return cond.result(
        f"{len(want)} ids equal with {min(lengths)}-{max(lengths)} drafts a step by prompt "
        f"lookup, with drafts right twice a step ({calls} calls), with random drafts"
        + (f", and beside {len(others)} sequences decoding" if others else ""))


def check_generate_speculation(grpc_url, http_url, model, prompt, want, methods,
                               metrics_url, sequence_model, every_draft_stands=False):
    """Generate model `model` speculating by each of `methods` at 1, 2, 4 and 8 drafts a step
    (fixed), over gRPC and HTTP (Triton's generate extension): len(want) ids equal `want`, and
    `sequence_model` verified drafts (its counters), all of them accepted when
    `every_draft_stands` (a draft model that is the target's twin)."""
    cond = Conditions()
    n = len(want)
    before = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    for method in methods:
        for k in (1, 2, 4, 8):
            for name, send, url in (("grpc", generate, grpc_url),
                                    ("http", generate_http, http_url)):
                got = send(url, model, input_ids=prompt, sampling={
                    "max_tokens": n, "ignore_eos": True, "speculative": {
                        "method": method, "num_draft_tokens": k, "adaptive": False}})
                cond(got.error is None and got.token_ids == want,
                     f"{method} at {k} over {name}: {got.error or got.token_ids}")
    after = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    drafted, accepted = (metric(after, name, model=sequence_model)
                         - metric(before, name, model=sequence_model)
                         for name in ("tlaloc_draft_tokens_total",
                                      "tlaloc_accepted_draft_tokens_total"))
    cond(drafted > 0, "no drafts were verified")
    cond(accepted == drafted or not every_draft_stands, f"{accepted} of {drafted} accepted")
    return cond.result(f"{n}/{n} equal with {' and '.join(methods)} at 1, 2, 4 and 8 drafts "
                       f"a step, over gRPC and HTTP; {accepted:.0f} of {drafted:.0f} drafts "
                       f"accepted")


def check_speculation_refusals(client, prompt, want, why):
    """On a model that cannot verify drafts (no verify entries, or linear-attention layers):
    drafts refused by name (INVALID_ARG, the message holding `why`), and draft_tokens that is
    not a count refused as malformed; the sequence then goes on with `want`."""
    cond = Conditions()
    sid = new_sequence_id()
    out = client.request(sid, prompt, start=True, outputs=("ARGMAX",))
    ids = [int(out["ARGMAX"][0])]
    for tokens, drafts, message in (([ids[0], 5, 6], 2, why),
                                    ([ids[0], 5], -1, "draft_tokens -1: expected an integer")):
        try:
            client.request(sid, tokens, outputs=("ACCEPTED_IDS",), draft_tokens=drafts)
            cond(False, f"draft_tokens {drafts} accepted")
        except InferError as e:
            cond(message in str(e) and "INVALID_ARG" in str(e), f"{e.status} {e}")
    for _ in range(len(want) - 1):
        ids.append(int(client.request(sid, [ids[-1]], outputs=("ARGMAX",))["ARGMAX"][0]))
    client.infer(sid, [], end=True)
    cond(ids == want, "the sequence did not go on with its greedy ids")
    return cond.result(f"refused by name ({why!r}; draft_tokens -1); the sequence went on "
                       f"with its greedy ids")


def check_windowed_vs_full(url, protocol, windowed, full, prompt, ring_pages, steps=20):
    """The windowed model against full-history pages, sent the same calls: the logits of every
    request within 1e-5 of the largest, and KV_PAGES as the sequence grows (the windowed pool
    at most `ring_pages`, the full pool growing)."""
    logs, pages = {}, []
    for model in (windowed, full):
        with TlalocClient(url, model, protocol) as c:
            sid = new_sequence_id()
            logits, kv = c.infer(sid, prompt, start=True, want_pages=True)
            out = [logits]
            for _ in range(steps):
                logits, kv = c.infer(sid, [int(np.argmax(logits))], want_pages=True)
                out.append(logits)
                if model == windowed:
                    pages.append(tuple(int(x) for x in kv))
            c.infer(sid, [], end=True)
        logs[model] = out
    worst = max(float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))
                for a, b in zip(logs[windowed], logs[full]))
    ring_ok = max(w for _, w in pages) <= ring_pages and pages[-1][0] > pages[0][0]
    return (f"worst {worst:.1e} of the largest logit over {steps + 1} requests; KV_PAGES "
            f"{pages[0]} -> {pages[-1]} (ring {ring_pages})", worst <= 1e-5 and ring_ok)


def check_quantized_bytes(metrics_url, model, plain_model, art, plain_art):
    """int8 weights and fp8 KV pools: the metrics report the weights' bytes (under half the
    plain model's) and a quarter of the plain model's pool bytes."""
    metrics = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    quant, plain = load_artifact(art), load_artifact(plain_art)

    def device_bytes(name, what):
        return metric(metrics, "tlaloc_device_bytes", model=name, what=what)
    weights = device_bytes(model, "weights")
    cond = Conditions()
    cond(weights == sum(w.byte_length for w in quant.weights), "weight bytes")
    cond(weights < 0.5 * device_bytes(plain_model, "weights"), "under half the plain weights")
    cond(device_bytes(model, "kv_pools") * 4 == device_bytes(plain_model, "kv_pools"),
         "a quarter of the plain pools")
    cond(plain.model.kv_dtype == "f32" and quant.model.kv_dtype == "f8E4M3FN", "kv dtypes")
    return cond.result(f"weights {weights:.0f} bytes; pools a quarter of {plain_model}'s")


# ---------------------------------------------------------------- refusals and the pool

def check_refusals(client, protocol, solo=None, prompt=(1, 17, 99, 3, 200),
                   sequence_cases=SEQUENCE_REFUSALS, start_cases=START_REFUSALS):
    """On the small model: each of `sequence_cases` refused by code and message naming the
    sequence, after which the sequence continues with its solo ids (the server's, unless
    `solo`); then each of `start_cases` refused as a START."""
    prompt = list(prompt)
    solo = solo if solo is not None else client.generate_greedy(prompt, 6).generated_ids
    sid = new_sequence_id()
    logits, pages = client.infer(sid, prompt, start=True, want_pages=True)
    seen, notes = [], []
    for tokens, code, msg in sequence_cases:
        err = refusal(client, sid, tokens)
        seen.append(code_of(err, protocol) == code and msg in str(err)
                    and f"sequence {sid}" in str(err))
        if not seen[-1]:
            notes.append(describe(err)[:80])
    cont = continue_greedy(client, sid, logits, 6)
    client.infer(sid, [], end=True)
    for tokens, msg in start_cases:
        err = refusal(client, new_sequence_id(), tokens, start=True)
        seen.append(code_of(err, protocol) == "INVALID_ARG" and msg in str(err))
        if not seen[-1]:
            notes.append(describe(err)[:80])
    pages_ok = list(pages) == [1, 0]
    if not pages_ok:
        notes.append(f"KV_PAGES after the START {list(pages)}, not [1, 0]")
    observed = (f"{sum(seen)}/{len(seen)} refused by name; continued with "
                f"{'its solo ids' if cont == solo else 'other ids'}")
    return "; ".join([observed] + notes), all(seen) and cont == solo and pages_ok


def check_full_pool(client, protocol, solo=None):
    """On the small model (8 pages of 8 tokens): a holds 5 pages, b the last 3; b's next step
    needs a fourth and is refused as UNAVAILABLE saying how many sequences hold pages but
    naming no other sequence (a correlation id is a sequence's only capability); after a's END
    the same request succeeds and b goes on with its solo ids (the server's, unless `solo`)."""
    prompt_b = list(range(20, 44))  # 24 tokens: 3 pages
    solo = solo if solo is not None else client.generate_greedy(prompt_b, 4).generated_ids
    a, b = new_sequence_id(), new_sequence_id()
    client.infer(a, list(range(60, 100)), start=True)  # 40 tokens: 5 pages
    logits_b, _ = client.infer(b, prompt_b, start=True)
    first = int(np.argmax(logits_b))
    err = refusal(client, b, [first])  # position 24 needs a fourth page
    named = (code_of(err, protocol) == "UNAVAILABLE" and "KV pool full" in str(err)
             and "2 sequences hold pages" in str(err) and str(a) not in str(err))
    client.infer(a, [], end=True)
    logits, pages = client.infer(b, [first], want_pages=True)  # the same request again
    cont = [first] + continue_greedy(client, b, logits, 3)
    client.infer(b, [], end=True)
    pages_ok = list(pages) == [4, 0]
    observed = (f"{'UNAVAILABLE naming no other id' if named else describe(err)[:60]}; then "
                f"{'its solo ids' if cont == solo else 'other ids'}")
    if not pages_ok:
        observed += f"; KV_PAGES {list(pages)}, not [4, 0]"
    return observed, named and cont == solo and pages_ok


def check_largest_context_step(client, protocol):
    """On the small model: a sequence at the largest context (64) is refused one more step by
    name."""
    c = new_sequence_id()
    logits, _ = client.infer(c, list(range(100, 163)), start=True)
    logits, pages = client.infer(c, [int(logits.argmax())], want_pages=True)
    err = refusal(client, c, [int(logits.argmax())])
    client.infer(c, [], end=True)
    ok = (list(pages) == [8, 0] and code_of(err, protocol) == "INVALID_ARG"
          and "65 positions would exceed the largest context 64" in str(err))
    return f"KV_PAGES {list(pages)} at 64 positions; the next step: {describe(err)[:80]}", ok


def check_second_start(client, protocol):
    """A refused second START on a held id: the earlier KV must not be continued."""
    sid = new_sequence_id()
    client.infer(sid, [1, 17, 99, 3, 200], start=True)
    first = refusal(client, sid, list(range(10, 75)), start=True)  # refused START
    after = refusal(client, sid, [5])
    client.infer(sid, [], end=True)
    not_held = after is not None and "is not held" in str(after)
    ok = code_of(first, protocol) == "INVALID_ARG" and not_held
    return (f"second START refused; the next step: "
            f"{'refused, not held' if not_held else describe(after)[:60]}", ok)


def check_state_slot(client, protocol, prompts, want):
    """A model with one state slot: b is refused by name while a holds it (a's id not told);
    a goes on; after
    a's END b reuses the slot (not cleared) and gives its reference ids."""
    a, b = new_sequence_id(), new_sequence_id()
    logits, _ = client.infer(a, prompts[0], start=True)
    err = refusal(client, b, prompts[1], start=True)
    named = (code_of(err, protocol) == "UNAVAILABLE"
             and "no free linear-attention state slot" in str(err)
             and "1 sequences hold slots" in str(err) and str(a) not in str(err))
    ids_a = continue_greedy(client, a, logits, len(want[0]))
    client.infer(a, [], end=True)
    logits, _ = client.infer(b, prompts[1], start=True)
    ids_b = continue_greedy(client, b, logits, len(want[1]))
    client.infer(b, [], end=True)
    ok = [named, ids_a == want[0], ids_b == want[1]]
    return (f"refused by name: {ok[0]}; holder's ids equal: {ok[1]}; the reusing "
            f"sequence's ids equal: {ok[2]}", all(ok))


def check_state_slot_metrics(metrics_url, model):
    """After check_state_slot: no slot used by a live sequence, one free or kept for the ended
    sequence's next turn (KV reuse), a refusal for want of a slot counted."""
    m = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    used = metric(m, "tlaloc_state_slots_used", model=model)
    free = metric(m, "tlaloc_state_slots_free", model=model)
    kept = metric(m, "tlaloc_kv_pages_cached", model=model, pool="state")
    refused = metric(m, "tlaloc_refusals_total", model=model, reason="state_slots")
    return (f"{used:.0f} used, {free:.0f} free, {kept:.0f} kept, {refused:.0f} refused",
            used == 0 and free + kept == 1 and refused >= 1)


# ---------------------------------------------------------------- outputs and metrics

def check_small_outputs(client, prompt=TINY_PROMPT, steps=32, k=4):
    """ARGMAX equals the argmax of LOGITS on each step, TOP_K their K largest log-probabilities;
    a request naming only ARGMAX gets 4 bytes and no LOGITS; the greedy ids through ARGMAX equal
    those through LOGITS; a bad top_k is refused by name."""
    every = ("LOGITS", "ARGMAX", "TOP_K_IDS", "TOP_K_LOGPROBS")
    cond = Conditions()
    sid = new_sequence_id()
    out = client.request(sid, prompt[:5], start=True, top_k=k, outputs=every)
    for step in range(steps):
        logits = out["LOGITS"]
        z = logits.astype(np.float64)
        top = np.argsort(-logits, kind="stable")[:k]
        cond(out["ARGMAX"].tolist() == [int(np.argmax(logits))], f"step {step}: ARGMAX")
        cond(out["TOP_K_IDS"].tolist() == top.tolist(), f"step {step}: TOP_K_IDS")
        want = z[top] - z.max() - np.log(np.exp(z - z.max()).sum())
        got = out["TOP_K_LOGPROBS"]
        cond(got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=0),
             f"step {step}: TOP_K_LOGPROBS")
        out = client.request(sid, [int(out["ARGMAX"][0])], top_k=k, outputs=every)
    small = client.request(sid, [int(out["ARGMAX"][0])], outputs=("ARGMAX",))
    cond(set(small) == {"ARGMAX"} and sum(a.nbytes for a in small.values()) == 4,
         f"ARGMAX alone: {sorted(small)}")
    cond(out["LOGITS"].nbytes == 256 * 4, "LOGITS bytes")
    try:
        client.request(sid, [1], outputs=("TOP_K_IDS",), top_k=0)
        cond(False, "top_k 0 accepted")
    except InferError as e:
        cond(re.search("parameter top_k 0", str(e)), f"top_k 0: {e}")
    client.infer(sid, [], end=True)
    by_logits = client.generate_greedy(prompt, 16).generated_ids
    cond(client.generate_greedy(prompt, 16, argmax_output=True).generated_ids == by_logits,
         "ids through ARGMAX")
    return cond.result(f"{steps} steps: ARGMAX and TOP_K as the logits; ARGMAX alone 4 bytes")


def check_metrics(metrics_url, client, art, free_pages):
    """A 3-token prompt and 4 steps, and a refused START, on a model with no other traffic:
    the counters' changes, the pool (none used, `free_pages` free or cached) and device bytes,
    and the call phases."""
    model = client.model
    before = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    client.generate_greedy([1, 2, 3], 5)
    refused = refusal(client, new_sequence_id(), [1, 999], start=True)
    after = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)

    def delta(name, **labels):
        return metric(after, name, model=model, **labels) - metric(before, name, model=model,
                                                                   **labels)
    a = load_artifact(art)
    m = a.model  # K and V of each layer, f32
    cond = Conditions()
    cond(refused is not None, "the START with id 999 accepted")
    for name, labels, want in (
            ("tlaloc_executions_total", dict(kind="prefill"), 1),
            ("tlaloc_executions_total", dict(kind="decode"), 4),
            ("tlaloc_tokens_total", dict(kind="prefill"), 3),
            ("tlaloc_tokens_total", dict(kind="decode"), 4),
            ("tlaloc_refusals_total", dict(reason="token"), 1),
            ("tlaloc_backend_wait_seconds_count", {}, 5),
            ("tlaloc_execution_seconds_count", dict(kind="decode"), 4),
            ("tlaloc_batch_size_bucket", dict(kind="decode", le="1"), 4)):
        cond(delta(name, **labels) == want, f"{name}{labels} changed {delta(name, **labels)}")
    cached = metric(after, "tlaloc_kv_pages_cached", model=model, pool="full")
    cond(cached >= 1, "the ended sequence's page not kept for its next turn")
    layer_pools = sum(p.stacked_layers for p in a.pools)  # a K and a V per layer, stacked or not
    for name, labels, want in (
            ("tlaloc_kv_pages_used", dict(pool="full"), 0),
            ("tlaloc_kv_pages_free", dict(pool="full"), free_pages - cached),
            ("tlaloc_sequences_held", {}, 0),
            ("tlaloc_device_bytes", dict(what="weights"), sum(w.byte_length for w in a.weights)),
            ("tlaloc_device_bytes", dict(what="kv_pools"),
             layer_pools * m.num_blocks * m.block_size * m.kv_heads * m.head_size * 4)):
        value = metric(after, name, model=model, **labels)
        cond(value == want, f"{name}{labels} {value}, not {want}")
    # The process holds at least its weights and pools (on the CPU device, in its own memory).
    resident = metric(after, "tlaloc_resident_bytes", model=model)
    held = sum(w.byte_length for w in a.weights) + layer_pools * m.num_blocks * m.block_size \
        * m.kv_heads * m.head_size * 4
    cond(resident > held, f"tlaloc_resident_bytes {resident}, not above weights and pools {held}")
    # The step phases (metrics.CallTiming): the executable's share of the decode calls' time.
    cond(delta("tlaloc_call_phase_seconds_total", kind="decode", phase="execute") > 0,
         "no execute phase time")
    cond(delta("tlaloc_response_send_seconds_count") >= 6, "response sends")
    return cond.result("counters, pool and device bytes as the requests sent")


def check_donation(server, model, control):
    """101 runs of each (over gRPC): the model's KV pools donated, updated in place 100/100;
    the control's (donate_kv_pools false) copied 100/100; the same ids."""
    ids = {}
    for name in (model, control):
        with TlalocClient(server.grpc_url, name, "grpc") as c:
            ids[name] = c.generate_greedy([1, 5, 9], 101).generated_ids
    want_in_place = (f"[tlaloc {model}] KV pools over the first 100 runs: in place 100/100, "
                     f"copied 0/100")
    want_copied = (f"[tlaloc {control}] KV pools over the first 100 runs: in place 0/100, "
                   f"copied 100/100")
    # The model process logs its line after the 100th run's reply: on loaded cores it can
    # reach the server's log after the client has its ids (a fresh-clone run read it too early).
    deadline = time.monotonic() + 10
    while True:
        log = server.log_text()
        in_place, copied = want_in_place in log, want_copied in log
        if (in_place and copied) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    same = ids[model] == ids[control]
    return (f"in place 100/100: {in_place}; control copied 100/100: {copied}; same ids: "
            f"{same}", in_place and copied and same)


# ---------------------------------------------------------------- batching

def lone_sequence_wait(metrics_url, url, protocol, model):
    """100 decode steps of one sequence: the share of requests that waited under 0.5 ms in the
    backend, Triton's queue time per request, and ms/token."""
    def run():
        with TlalocClient(url, model, protocol) as c:
            return c.generate_greedy([1, 5, 9, 14], 101)
    gen, delta = metrics_delta(metrics_url, run)
    n = delta("tlaloc_backend_wait_seconds_count", model=model)
    under = delta("tlaloc_backend_wait_seconds_bucket", model=model, le="0.0005")
    queue_us = delta("nv_inference_queue_duration_us", model=model) / max(
        1, delta("nv_inference_request_success", model=model))
    return under / max(n, 1), queue_us, gen.ms_per_token


def check_lone_sequence_wait(metrics_url, url, protocol, model, control):
    """The backend's batching runs a lone sequence's steps without waiting: over half under
    0.5 ms; the control (Triton's batching) is observed alongside."""
    share, queue, ms = lone_sequence_wait(metrics_url, url, protocol, model)
    _, c_queue, c_ms = lone_sequence_wait(metrics_url, url, protocol, control)
    return (f"{share:.0%} under 0.5 ms, Triton queue {queue:.0f} us, {ms:.2f} ms/token; "
            f"control: Triton queue {c_queue:.0f} us, {c_ms:.2f} ms/token", share > 0.5)


def paused_sequences(metrics_url, url, protocol, model, steps=15, seed=0):
    """Four sequences started together whose clients pause a random 0-5 ms before each step:
    decode executions for their 4 x steps steps, and whether each equals its solo run."""
    prompts = [TINY_PROMPT[:n] for n in (4, 6, 9, 13)]
    solo = solo_runs(url, protocol, model, prompts, steps + 1)
    barrier = threading.Barrier(4, timeout=120)
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

    _, delta = metrics_delta(metrics_url, lambda: run_parallel(worker, 4))
    return int(delta("tlaloc_executions_total", model=model, kind="decode")), got == solo


def check_paused_sequences(metrics_url, url, protocol, model, control):
    """Four pausing sequences (60 steps): at most 16 decode executions and their solo ids; the
    control (Triton's batching after a 1 ms delay) needs more executions."""
    execs, same = paused_sequences(metrics_url, url, protocol, model)
    c_execs, _ = paused_sequences(metrics_url, url, protocol, control)
    return (f"{execs} executions, solo ids {same}; control (Triton, 1 ms delay): {c_execs} "
            f"executions", execs <= 16 and same and c_execs > execs)


def check_prompts_together(metrics_url, url, protocol, model, n, tries=10):
    """n prompts sent at once share one prefill execution, and each prompt's 8 greedy ids equal
    its solo run. The backend merges the prompts that reach its batcher within the prefill
    window (2 ms from the first), and prompts sent at once do not always reach it so on a
    2-core machine that also runs the server: 4 prompts from 4 threads over HTTP took two or
    three calls in 1 to 2 tries of 3, from 4 processes in 1 try of 10 (gRPC: 2 of 10). So the
    prompts are sent again, up to `tries` times, until a try shares one call; every try must
    give the solo ids. Each try has a cache salt of its own: the prompts' blocks cached by
    the solo runs or an earlier try would be reused, their prompts needing no prefill call."""
    prompts = [TINY_PROMPT[:k] for k in (5, 8, 11, 14)][:n]
    solo = solo_runs(url, protocol, model, prompts, 8)
    calls, same = [], True
    while len(calls) < tries and 1 not in calls:
        salt = f"together-{uuid.uuid4().hex}"
        got, delta = metrics_delta(metrics_url, lambda: greedy_together(
            url, protocol, model, prompts, 8, cache_salt=salt))
        calls.append(int(delta("tlaloc_executions_total", model=model, kind="prefill")))
        same = same and got == solo
    return (f"prefill calls per try: {', '.join(map(str, calls))}; solo ids: {same}",
            calls[-1] == 1 and same)


# ---------------------------------------------------------------- generation on the server

def check_generate_model(grpc_url, model, prompt, want):
    """`{model}_generate` (decoupled: gRPC streams only): len(want) greedy ids streamed equal
    `want` (transformers')."""
    n = len(want)
    got = generate(grpc_url, f"{model}_generate", input_ids=prompt,
                   sampling={"max_tokens": n, "ignore_eos": True})
    same = sum(a == b for a, b in zip(got.token_ids, want))
    return (f"{same}/{n} equal in {got.responses} streamed responses, first token "
            f"{got.first_token_ms:.0f} ms", same == n)


def openai_chat(grpc_url: str, model: str, messages: list[dict]) -> str:
    """A greedy 32-token chat completion from the openai package through `tlaloc openai` (run in
    a thread on a free loopback port, in front of `{model}_generate`)."""
    import openai

    from triton_tlaloc.frontends.openai_server import ServedModel, serve_in_thread

    base_url, stop = serve_in_thread(grpc_url, {model: ServedModel.discover(grpc_url, model)})
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        chat = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                              max_tokens=32)
        return chat.choices[0].message.content
    finally:
        stop()


def check_openai_chat(grpc_url, model, messages, prompt):
    """`tlaloc openai` in front of the generate model: the openai package's chat completion is
    the generate model's text for the chat prompt."""
    text = openai_chat(grpc_url, model, messages)
    plain = generate(grpc_url, f"{model}_generate", input_ids=prompt,
                     sampling={"max_tokens": 32})
    return f"{text[:40]!r}", text == plain.text


# ---------------------------------------------------------------- reclamation

def check_reclamation(server, url, protocol, model="reclaim"):
    """The small pool (8 pages of 8 tokens; Triton ends a sequence idle 1 s; reclaimable after
    2.5 s). Abandoned a (4 pages) and b (2 pages), live c (2 pages, a step every 0.6 s): a new
    prompt needing 2 pages reclaims a only. The prompts share no block (prefix reuse would
    share pages between them); an ended sequence's pages, kept for its next turn, are taken
    before any sequence is reclaimed. Then f (4 pages), whose client keeps being refused,
    is not reclaimed; once f ends, b is. Yields ("lru", result), ("refused_kept", result) and
    ("live", result) as each is known."""
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

    def reclaimed(k):
        return f"reclaimed sequence {ids[k]}:" in server.log_text()

    with TlalocClient(url, model, protocol) as c:
        c.infer(ids["a"], list(range(20, 52)), start=True)  # 4 pages, abandoned
        time.sleep(0.2)
        c.infer(ids["b"], list(range(52, 68)), start=True)  # 2 pages, abandoned
        t_c = threading.Thread(target=live_c)
        t_c.start()
        time.sleep(3.2)  # a and b past the rule; c has taken its second page: the pool is full
        c.infer(ids["d"], list(range(68, 84)), start=True)  # needs 2 pages
        lru = reclaimed("a") and not reclaimed("b")
        yield "lru", ("a reclaimed, b kept" if lru else "other (see log)", lru)
        c.infer(ids["d"], [], end=True)
        c.infer(ids["f"], list(range(84, 116)), start=True)  # 4 pages: full (b2 c2 f4)
        for _ in range(8):  # f's client is refused (an id outside the vocabulary) again and again
            time.sleep(0.4)
            refusal(c, ids["f"], [999])
        err = refusal(c, ids["g"], list(range(116, 164)), start=True)  # needs 6 pages
        kept = (code_of(err, protocol) == "UNAVAILABLE" and "sequences hold pages" in str(err)
                and str(ids["f"]) not in str(err) and not reclaimed("f"))
        c.infer(ids["f"], [], end=True)
        g_ok = refusal(c, ids["g"], list(range(116, 164)), start=True) is None
        c.infer(ids["g"], [], end=True)
        b_gone = reclaimed("b")
        yield "refused_kept", (f"f kept: {kept}; g then: {g_ok}; b reclaimed: {b_gone}",
                               kept and g_ok and b_gone)
        t_c.join(60)
    yield "live", ("its solo ids" if c_ids == c_solo else f"{c_ids} != {c_solo}",
                   c_ids == c_solo)


# ---------------------------------------------------------------- soak

class _GiveUp(Exception):
    pass


def _soak_call(c, sid, tokens, retries, lock, **kw):
    """A full pool: the same request again after 50 ms, for up to 2 s (then give up and END,
    so that sequences all waiting for pages cannot wait for each other forever)."""
    until = time.monotonic() + 2.0
    while True:
        try:
            return c.infer(sid, tokens, **kw)[0]
        except InferError as e:
            if "KV pool full" not in str(e) or time.monotonic() > until:
                if "KV pool full" in str(e):
                    raise _GiveUp() from None
                raise
            with lock:
                retries[0] += 1
            time.sleep(0.05)


def _soak_sequences(server, model, seconds, n=16) -> dict:
    """n clients (alternating HTTP and gRPC) run random sequences until the deadline, some
    abandoned without END: the completed (prompt, ids), abandoned (id, positions), errors,
    full-pool retries and sequences given up."""
    deadline = time.monotonic() + seconds
    r = dict(done=[], abandoned=[], errors=[], retries=[0], gave_up=[0])
    lock = threading.Lock()

    def worker(i):
        rng = random.Random(1000 + i)
        protocol = PROTOCOLS[i % 2]
        with TlalocClient(url_of(server, protocol), model, protocol) as c:
            while time.monotonic() < deadline:
                prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]
                steps = rng.randint(2, 40)
                abandon = rng.random() < 0.15
                sid = new_sequence_id()
                try:
                    logits = _soak_call(c, sid, prompt, r["retries"], lock, start=True)
                    ids = []
                    for k in range(steps):
                        ids.append(int(np.argmax(logits)))
                        if abandon and k == steps // 2:
                            break
                        logits = _soak_call(c, sid, [ids[-1]], r["retries"], lock)
                    if abandon:
                        with lock:
                            r["abandoned"].append((sid, len(prompt) + len(ids) - 1))
                        continue
                    ids.append(int(np.argmax(logits)))
                    c.infer(sid, [], end=True)
                    with lock:
                        r["done"].append((prompt, ids))
                except _GiveUp:
                    c.infer(sid, [], end=True)  # also closes a START the pool refused
                    with lock:
                        r["gave_up"][0] += 1
                except Exception as e:
                    with lock:
                        r["errors"].append(f"{type(e).__name__}: {e}")
    run_parallel(worker, n, timeout=None)  # the soak ends at its own deadline
    return r


def soak(server, model, artifact, seconds, block_size=8):
    """16 sequences of random lengths for `seconds` over HTTP and gRPC on a 64-page pool, some
    abandoned without END; a full pool is retried after 50 ms (the request is unchanged by a
    refusal). Yields ("books", result): no page is leaked; then ("runs", result): every
    completed sequence equals its solo run (the artifact's Engine) and no error."""
    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.runtime.core import Runtime

    r = _soak_sequences(server, model, seconds)
    # Abandoned sequences hold their pages until reclaimed: the books must balance exactly.
    log = server.log_text()
    abandoned = r["abandoned"]
    reclaimed = {sid for sid, _ in abandoned if f"reclaimed sequence {sid}:" in log}
    expect_pages = sum(-(-n // block_size) for sid, n in abandoned if sid not in reclaimed)
    m = scrape_metrics(server.metrics_url, settle_s=METRICS_SETTLE_S)
    used = metric(m, "tlaloc_kv_pages_used", model=model)
    held = metric(m, "tlaloc_sequences_held", model=model)
    yield "books", (f"{int(used)} used, {expect_pages} expected; {int(held)} held; "
                    f"{len(reclaimed)} of {len(abandoned)} abandoned reclaimed",
                    used == expect_pages and held == len(abandoned) - len(reclaimed))
    engine = Engine(Runtime(artifact))
    done, errors = r["done"], r["errors"]
    same = sum(engine.generate_greedy(p, len(ids)).generated_ids == ids for p, ids in done)
    if errors:
        print("soak errors:", errors[:5], file=sys.stderr)
    yield "runs", (f"{same}/{len(done)} equal; {len(errors)} errors; {r['retries'][0]} "
                   f"full-pool retries, {r['gave_up'][0]} given up",
                   same == len(done) and not errors and len(done) > 0)


def first_requests_at_ready(server, prompts: dict[str, dict[str, list[int]]], steps: int,
                            generate_models=True) -> tuple[dict, bool]:
    """Start `server` without waiting for its background compiles and, the moment it reports
    ready, send every model's prompts (`prompts[model][key]`) all at once: greedy over gRPC and
    HTTP, and through MODEL_generate. Returns ({(model, key, via): ids, or the error's text},
    whether compiles were still running when they were sent)."""
    from triton_tlaloc.frontends.client import generate

    server.start(wait_compiled=False)
    compiling = not server.compiled()
    vias = ("grpc", "http") + (("generate",) if generate_models else ())
    jobs = [(m, k, via) for m, ps in prompts.items() for k in ps for via in vias]
    got, lock = {}, threading.Lock()

    def send(i):
        model, key, via = jobs[i]
        prompt = prompts[model][key]
        if via == "generate":
            r = generate(server.grpc_url, f"{model}_generate", input_ids=prompt,
                         sampling={"max_tokens": steps, "ignore_eos": True})
            ids = r.token_ids if r.error is None else r.error
        else:
            with TlalocClient(url_of(server, via), model, via) as c:
                try:
                    ids = c.generate_greedy(prompt, steps).generated_ids
                except Exception as e:  # recorded: the caller compares and names it
                    ids = f"{type(e).__name__}: {e}"
        with lock:
            got[jobs[i]] = ids
    run_parallel(send, len(jobs))
    return got, compiling


def check_first_requests(got: dict, want: dict, log: str):
    """Every first request got transformers' ids (`want[model][key]`) and the log holds no
    INTERNAL error."""
    wrong = {job: ids for job, ids in got.items() if ids != want[job[0]][job[1]]}
    internal = "INTERNAL" in log or "AssertionError" in log
    return (f"{len(got) - len(wrong)} of {len(got)} first requests with transformers' ids"
            f"{'; INTERNAL in the log' if internal else ''}"
            f"{f'; wrong: {wrong}' if wrong else ''}"), not wrong and not internal

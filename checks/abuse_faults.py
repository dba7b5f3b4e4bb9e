"""Faults a hostile client found in the newer surfaces (adapters loaded while serving, cache
salts past Triton, NaN from an adapter, grammars, prompt logprobs, the page metrics), each tried
against a real server while STREAMS other generations are in flight.

The target serves SmolLM2 exported with adapter pools, prefix reuse and a small host tier, as
`tlaloc serve` + `tlaloc openai --api-key --admin-key` with `--lora-updates-root` give it; the
adapter TENANT is loaded through the admin route before the cases. `run_fault_case` starts the
streams (greedy, through the generate model, each with a prompt of its own), runs one case, and
then checks what every case must leave as it was: each stream finished with its solo ids, no
page is held once they end, TENANT still serves and no adapter was added (EVIL unknown), and a
stream's prompt sent again finds its blocks cached and gives its solo ids. scripts/abuse.py
prints the table beside abuse_cases.py's; tests/test_faults.py asserts each row.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from triton_tlaloc.frontends.client import (InferError, TlalocClient, generate, metric,
                                            new_sequence_id, scrape_metrics)

from .abuse_cases import API_KEY, GENERATE, MODEL, Target, completion, openai_request
from .reuse_checks import Counters

# SmolLM2 exported with adapter pools and verify entries (prompt logprobs), 64 pages of 16,
# a context long enough for the most prompt tokens scored (512)
EXPORT = dict(batch_ladder=(1, 4), context_ladder=(1024,), prefill_tokens=(64, 128),
              num_blocks=65, block_size=16, max_lora_rank=4, lora_slots=2, verify_tokens=(9,))
STREAMS = 6  # generations in flight during every case
STREAM_TOKENS = 12
ADMIN_KEY = "abuse-admin-key"
ADMIN_HEADER = "x-tlaloc-admin-key"
TENANT = "tenant"  # an adapter loaded through the admin route before the cases
EVIL = "evil"  # a name no case may get loaded
# SmolLM2's attention output projection: the modules the cases' adapters adapt
HIDDEN = 576
ADAPTED_LAYERS = (0, 1)


@dataclass
class FaultTarget(Target):
    admin_key: str = ADMIN_KEY
    updates_root: Path = Path()
    prompts: list = field(default_factory=list)  # each stream's prompt
    solo: list = field(default_factory=list)  # each stream's solo ids
    nan_solo: list | None = None  # NAN_PROMPTS' solo ids, once a case needs them


# ------------------------------------------------------------------ adapters as PEFT saves them

def write_adapter(path: Path, kind: str, seed: int = 0) -> Path:
    """A PEFT LoRA adapter of SmolLM2's o_proj in two layers: `kind` "small" (a working
    adapter), "nan" (lora_B all NaN), "rank0" (rank-0 tensors), or "overflow" (finite values
    so large that the update overflows to infinity: NaN logits from an adapter that loads)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    rank = 0 if kind == "rank0" else 2
    tensors = {}
    for layer in ADAPTED_LAYERS:
        key = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        a = rng.standard_normal((rank, HIDDEN)).astype(np.float32) * 0.01
        b = rng.standard_normal((HIDDEN, rank)).astype(np.float32) * 0.01
        if kind == "nan":
            b[:] = np.nan
        elif kind == "overflow":
            a[:], b[:] = 1e20, 1e20
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "bias": "none", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": ["o_proj"]}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def admin_route(t: FaultTarget, verb: str, body: dict, key: str | None = ADMIN_KEY):
    """(status, body text) of tlaloc openai's /v1/{verb}_lora_adapter."""
    headers = {ADMIN_HEADER: key} if key is not None else {}
    status, _, text = openai_request(t, f"/{verb}_lora_adapter", body, headers=headers)
    return status, text


def sequence_admin(t: FaultTarget, command: dict, protocol: str, key: str | None):
    """The sequence model's lora_admin parameter sent straight to Triton's inference port:
    "accepted" or the refusal's message."""
    url = t.server.http_url if protocol == "http" else t.server.grpc_url
    with TlalocClient(url, MODEL, protocol) as c:
        try:
            c.request(new_sequence_id(), [1], start=True, end=True, outputs=("KV_PAGES",),
                      admin=command, admin_key=key)
            return "accepted"
        except InferError as e:
            return str(e)


def adapters_as_loaded(t: FaultTarget) -> str | None:
    """None when TENANT serves and EVIL is unknown; else what differs."""
    with TlalocClient(t.server.grpc_url, MODEL, "grpc") as c:
        for name, known in ((TENANT, True), (EVIL, False)):
            sid = new_sequence_id()
            try:
                c.request(sid, [1, 2, 3], start=True, outputs=("ARGMAX",), lora=name)
                c.request(sid, [], end=True, outputs=("ARGMAX",))
                if not known:
                    return f"adapter {name} is loaded"
            except InferError as e:
                if known or "unknown adapter" not in str(e):
                    return f"adapter {name}: {e}"
    return None


# ------------------------------------------------------------------ the streams in flight

def stream(t: FaultTarget, prompt: list[int], max_tokens: int = STREAM_TOKENS, **sampling):
    """One greedy generation through the generate model (the path tlaloc openai takes)."""
    return generate(t.server.grpc_url, GENERATE, input_ids=prompt, timeout_s=300, sampling={
        "max_tokens": max_tokens, "ignore_eos": True, **sampling})


class Streams:
    """STREAMS generations on threads of their own, started before a case; `finish` waits for
    them and says which did not give their solo ids."""

    def __init__(self, t: FaultTarget):
        self.t, self.got = t, [None] * STREAMS
        self.first = [threading.Event() for _ in range(STREAMS)]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(STREAMS)]
        for th in self.threads:
            th.start()
        for e in self.first:
            e.wait(120)

    def _run(self, i: int) -> None:
        try:
            self.got[i] = generate(
                self.t.server.grpc_url, GENERATE, input_ids=self.t.prompts[i], timeout_s=300,
                on_text=lambda _: self.first[i].set(),
                sampling={"max_tokens": STREAM_TOKENS, "ignore_eos": True})
        finally:
            self.first[i].set()

    def finish(self) -> list[str]:
        for th in self.threads:
            th.join(300)
        wrong = []
        for i, g in enumerate(self.got):
            if g is None or g.error is not None:
                wrong.append(f"stream {i}: {'no result' if g is None else g.error[:120]}")
            elif g.token_ids != self.t.solo[i]:
                wrong.append(f"stream {i}: ids differ from solo")
        return wrong


def pages_used(t: FaultTarget) -> float:
    return metric(scrape_metrics(t.server.metrics_url), "tlaloc_kv_pages_used", model=MODEL)


def settled_pages(t: FaultTarget, within_s: float = 10.0) -> float:
    """MODEL's live pages once they fall to 0 (or after `within_s`)."""
    deadline = time.monotonic() + within_s
    while (used := pages_used(t)) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return used


def run_fault_case(t: FaultTarget, fn) -> dict:
    """One case with STREAMS generations in flight: {observed, ok, streams_equal, ready,
    left}: `left` lists what the case left changed (pages held, adapters, the prefix cache)."""
    streams = Streams(t)
    try:
        observed, ok = fn(t)
    except Exception as e:
        observed, ok = f"{type(e).__name__}: {e}", False
    wrong = streams.finish()
    left = []
    if (used := settled_pages(t)) > 0:
        left.append(f"{used:.0f} pages held after the streams ended")
    if (changed := adapters_as_loaded(t)) is not None:
        left.append(changed)
    # what the cache offers now is what the streams computed: sent again, a stream's prompt
    # (its blocks cached, unless evicted since) gives its solo ids
    again = stream(t, t.prompts[-1])
    if again.error is not None or again.token_ids != t.solo[-1]:
        left.append(f"a stream's prompt sent again: {again.error or 'ids differ from solo'}")
    return {"observed": observed + "".join(f"; {w}" for w in wrong + left),
            "ok": bool(ok), "streams_equal": not wrong, "ready": t.server.ready(),
            "left": left}


# ------------------------------------------------------------------ the cases

def case_admin_without_the_key(t):
    """lora_admin straight to Triton's inference port (HTTP and gRPC), no key or a wrong one:
    an unload of TENANT and a load of EVIL, each refused naming the key; nothing changes."""
    said = []
    for protocol in ("http", "grpc"):
        for key in (None, "wrong"):
            for command in ({"unload": TENANT}, {"load": {"name": EVIL, "path": "small"}}):
                said.append(sequence_admin(t, command, protocol, key))
    refused = sum("admin key" in s and "missing or wrong" in s for s in said)
    return f"{refused} of {len(said)} refused naming the admin key", refused == len(said)


def case_admin_nul_path(t):
    """A keyed load whose path holds a NUL: refused by name, before the batching thread."""
    said = sequence_admin(t, {"load": {"name": EVIL, "path": "a\0b"}}, "grpc", ADMIN_KEY)
    return said[:120], "U+0000" in said


def case_adapter_rank_zero(t):
    """/v1/load_lora_adapter of an adapter of rank 0 (alpha / r divided by zero)."""
    status, text = admin_route(t, "load", {"lora_name": EVIL, "lora_path": "rank0"})
    return f"{status}: {text[:120]}", status == 400 and "rank-r pair" in text


def case_adapter_nan(t):
    """/v1/load_lora_adapter of an adapter whose lora_B is NaN: refused by name at load."""
    status, text = admin_route(t, "load", {"lora_name": EVIL, "lora_path": "nan"})
    return f"{status}: {text[:120]}", status == 400 and "NaN or infinite" in text


NAN_SYSTEM_BLOCKS = 3  # the base streams' shared system prompt, in blocks: what they reuse
NAN_PROMPT_BLOCKS = 6  # each prompt's
NAN_STREAM_TOKENS = 4  # each base stream's: the prompts' KV is what is checked


def nan_prompts(t: FaultTarget) -> list[list[int]]:
    """16 prompts of NAN_PROMPT_BLOCKS blocks sharing a system prompt: two sets of 8 whose
    blocks together are more than the pool holds, so running one set after the other evicts
    the first's blocks to the host tier."""
    bs = t.block_size
    n = NAN_PROMPT_BLOCKS * bs
    assert 2 * (8 * (NAN_PROMPT_BLOCKS - NAN_SYSTEM_BLOCKS + 1)) + NAN_SYSTEM_BLOCKS > t.pages
    system = [1] + [(i * 37) % 30000 + 300 for i in range(NAN_SYSTEM_BLOCKS * bs - 1)]
    return [system + [(k * 131 + i * 17) % 30000 + 200 for i in range(n - len(system))]
            for k in range(16)]


def reuse_counters(t: FaultTarget) -> list[float]:
    seen = scrape_metrics(t.server.metrics_url, settle_s=0.6)
    return [metric(seen, name, model=MODEL) for name in (
        "tlaloc_prefix_cache_hits_total", "tlaloc_prefix_cache_host_hits_total",
        "tlaloc_nonfinite_logits_total")]


def case_nan_adapter_then_base_streams(t):
    """An adapter that loads but gives NaN logits (finite weights whose update overflows) runs
    8 chats over the prompts the base streams then send (each an error naming NaN; the pages
    it held then hold NaN) and is unloaded; then 64 base-model streams, 8 at a time, the two
    sets of nan_prompts in turn: 0 errors, every stream its solo ids, no row NaN, and both the
    prefix cache and the host tier served prompt tokens (so both paths ran)."""
    prompts = nan_prompts(t)
    if t.nan_solo is None:  # solo, before any NaN was computed
        t.nan_solo = [stream(t, p, NAN_STREAM_TOKENS).token_ids for p in prompts]
    status, text = admin_route(t, "load", {"lora_name": "overflow", "lora_path": "overflow"})
    if status != 200:
        return f"overflow adapter not loaded: {status} {text[:100]}", False
    bad = [None] * 8
    run_threads(lambda i: bad.__setitem__(i, stream(t, prompts[i], NAN_STREAM_TOKENS,
                                                     lora="overflow")), 8)
    nan_errors = sum(g is not None and g.error is not None and "NaN" in g.error for g in bad)
    unloaded, _ = admin_route(t, "unload", {"lora_name": "overflow"})
    before = reuse_counters(t)
    got = [None] * 64
    for wave in range(8):  # 8 at a time: each wave one set of prompts, the sets in turn
        run_threads(lambda i, w=wave: got.__setitem__(w * 8 + i, stream(
            t, prompts[(w % 2) * 8 + i], NAN_STREAM_TOKENS)), 8)
    hits, host_hits, nonfinite = (a - b for a, b in zip(reuse_counters(t), before))
    errors = [g.error[:80] if g is not None else "no result" for g in got
              if g is None or g.error is not None]
    wrong = sum(g is not None and g.error is None and
                g.token_ids != t.nan_solo[(i // 8 % 2) * 8 + i % 8] for i, g in enumerate(got))
    return (f"adapter's chats: {nan_errors} of 8 errors naming NaN; unloaded {unloaded}; base "
            f"streams: {len(errors)} errors {errors[:2]}, {wrong} of 64 ids not solo; "
            f"{hits:.0f} prompt tokens reused, {host_hits:.0f} from the host tier, "
            f"{nonfinite:.0f} rows NaN",
            nan_errors == 8 and unloaded == 200 and not errors and wrong == 0 and hits > 0
            and host_hits > 0 and nonfinite == 0)


def case_binary_salts(t):
    """Salts that differ after a NUL, as the CACHE_SALT input over HTTP and gRPC: no two share
    a block (the parameter would have cut them at the NUL)."""
    prompt = [1] + [(i * 37) % 20000 + 300 for i in range(3 * t.block_size + 1)]
    hits = []
    for protocol in ("http", "grpc"):
        url = t.server.http_url if protocol == "http" else t.server.grpc_url
        with TlalocClient(url, MODEL, protocol) as c:
            for salt in (b"g\0one" + protocol.encode(), b"g\0two" + protocol.encode()):
                counters = Counters(t.server.metrics_url)
                c.generate_greedy(prompt, 1, cache_salt=salt, argmax_output=True)
                hits.append(counters.delta(MODEL)["hits"])
    return f"tokens reused under each salt: {hits}", hits == [0, 0, 0, 0]


def _chat_seconds(t: FaultTarget) -> tuple[int, float]:
    """(status, seconds) of a plain 2-token completion through tlaloc openai."""
    t0 = time.perf_counter()
    status, _, _ = openai_request(t, "/completions", completion(
        "Hi", max_tokens=2, cache_salt=f"chat-{time.monotonic_ns()}"))
    return status, time.perf_counter() - t0


def _slow_schema(salt: int) -> dict:
    """An allOf of six 3-way anyOfs: about a second of llguidance's compile on a busy core; the
    property names differ by `salt`, so none is found compiled."""
    return {"allOf": [{"anyOf": [{"type": "object", "properties": {
        f"s{salt}_{i}_{j}": {"type": "integer"}}} for j in range(3)]} for i in range(6)]}


def case_grammar_compiles_beside_a_chat(t):
    """20 clients at once, each with a schema of its own that takes long to compile, and a
    plain chat through tlaloc openai 0.3 s later: the chat answers within twice its time alone
    (+0.5 s for the streams in flight); each constrained request is answered, refused by name
    or as busy, never an INTERNAL error."""
    _, alone = _chat_seconds(t)
    salt, answers = time.monotonic_ns() % 10**9, []

    def constrained(i: int) -> None:
        got = generate(t.server.grpc_url, GENERATE, input_ids=[1, 9690, 314], timeout_s=120,
                       sampling={"max_tokens": 4, "structured_output": {
                           "json_schema": _slow_schema(salt + i)}})
        answers.append(got.status or got.finish_reason)

    threads = [threading.Thread(target=constrained, args=(i,), daemon=True) for i in range(20)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    status, beside = _chat_seconds(t)
    for th in threads:
        th.join(120)
    ok = (status == 200 and beside <= 2 * alone + 0.5 and len(answers) == 20
          and "INTERNAL" not in answers)
    return (f"chat {alone:.2f} s alone, {beside:.2f} s beside 20 compiles; "
            f"{ {a: answers.count(a) for a in sorted(set(answers))} }", ok)


def case_forced_tokens_within_max_tokens(t):
    """`Q{100}` (an answer the grammar forces whole) with max_tokens 1: one Q, finish length,
    and the prefill runs the prompt alone (it ran the prompt and 100 forced tokens, 7 pages,
    for one token)."""
    def prefilled() -> float:
        return metric(scrape_metrics(t.server.metrics_url, settle_s=0.6),
                      "tlaloc_tokens_total", model=MODEL, kind="prefill")
    before = prefilled()
    status, _, text = openai_request(t, "/completions", completion(
        "Say Q", max_tokens=1, guided_regex="Q{100}"))
    ran = prefilled() - before
    choice = json.loads(text)["choices"][0] if status == 200 else {}
    ok = (status == 200 and choice.get("finish_reason") == "length"
          and choice.get("text") == "Q" and ran < 30)
    return (f"{status} {choice.get('finish_reason')} {choice.get('text')!r}, {ran:.0f} tokens "
            f"prefilled (the streams' included)", ok)


def case_token_ids_out_of_range(t):
    """stop_token_ids [1e9, -1], prompt [-1, 5] and /detokenize of the vocabulary's size:
    each a 400 naming the id and what is wrong with it."""
    said = [openai_request(t, "/completions", completion("hi", stop_token_ids=[1e9, -1])),
            openai_request(t, "/completions", completion([-1, 5])),
            openai_request(t, "/detokenize", {"model": MODEL, "tokens": [49152]}, root="")]
    wants = ("token id 1000000000 (at 0) is past the vocabulary", "token id -1 (at 0) is "
             "negative", "token id 49152 (at 0) is past the vocabulary")
    ok = all(got[0] == 400 and want in got[2] for got, want in zip(said, wants))
    return "; ".join(f"{got[0]} {got[2][:70]}" for got in said), ok


def case_gone_client_frees_its_choices(t):
    """Two non-streamed completions of n=16 whose clients give up after 1 s (32 generations,
    the server's concurrency limit): a completion sent 1 s later is answered, not 429, and
    every choice's pages are given back."""
    gone = []

    def give_up(i: int) -> None:
        try:
            openai_request(t, "/completions", completion("Once upon a time", n=16,
                                                         max_tokens=100), timeout=1.0)
        except OSError as e:  # (socket.timeout is one)
            gone.append(type(e).__name__)
    run_threads(give_up, 2)
    time.sleep(1.0)
    status, seconds = _chat_seconds(t)
    return (f"{len(gone)} clients gave up; a completion 1 s later: {status} in "
            f"{seconds:.2f} s", len(gone) == 2 and status == 200)


def _chat_first_token_s(t: FaultTarget, content: str) -> float:
    """A streamed chat's time to its first chunk with text."""
    host, port = t.openai_host
    conn = http.client.HTTPConnection(host, port, timeout=120)
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]})
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        for raw in conn.getresponse():
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]" and any(
                    c.get("delta", {}).get("content") for c in json.loads(line[5:])["choices"]):
                break
        return time.perf_counter() - t0
    finally:
        conn.close()


def case_long_prompt_logprobs_beside_chats(t):
    """prompt_logprobs 20 on a prompt of the most tokens scored (512) while others chat: a
    plain chat's median time to first token stays within twice its time alone, and the
    request is answered; one token longer is refused by name at once."""
    words = "river stone cloud paper garden window silver morning".split()

    def chat(i: int) -> str:  # a new message each time: no cached prefix
        return " ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + f" #{i}"
    alone = sorted(_chat_first_token_s(t, chat(i)) for i in range(3))[1]
    n = min(512, t.max_context - 8)
    ids = [int(x) for x in np.random.default_rng(0).integers(3, 49152, n)]
    over = openai_request(t, "/completions", completion(ids + [5], max_tokens=1,
                                                       prompt_logprobs=20))
    out = {}
    scorer = threading.Thread(target=lambda: out.update(got=openai_request(
        t, "/completions", completion(ids, max_tokens=1, prompt_logprobs=20), timeout=300)))
    scorer.start()
    time.sleep(0.5)
    during = []
    while scorer.is_alive() and len(during) < 20:
        during.append(_chat_first_token_s(t, chat(100 + len(during))))
    scorer.join(300)
    status = out["got"][0] if "got" in out else None
    mid = sorted(during)[len(during) // 2] if during else float("inf")
    return (f"{n + 1} tokens: {over[0]} {over[2][:60]}; {n} tokens answered {status}; a chat's "
            f"first token {alone:.2f} s alone, {mid:.2f} s during ({len(during)} chats)",
            over[0] == 400 and "prompt_logprobs" in over[2] and status == 200
            and bool(during) and mid <= 2 * alone)


def case_pages_used_while_sequences_held(t):
    """An n=4 completion of 40 tokens beside the streams, the metrics scraped every 0.2 s
    while it runs: whenever sequences are held, pages are used (both gauges count live
    sequences), and used + cached + free is the pool."""
    done, seen = threading.Event(), []

    def scrape():
        while not done.is_set():
            m = scrape_metrics(t.server.metrics_url)
            seen.append(tuple(metric(m, name, model=MODEL) for name in (
                "tlaloc_sequences_held", "tlaloc_kv_pages_used", "tlaloc_kv_pages_cached",
                "tlaloc_kv_pages_free")))
            time.sleep(0.2)
    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    status, _, _ = openai_request(t, "/completions", completion(
        "Once upon a time", n=4, max_tokens=40, ignore_eos=True))
    done.set()
    scraper.join(10)
    held = [s for s in seen if s[0] > 0]
    wrong = [s for s in held if s[1] == 0]
    sums = {round(used + cached + free) for _, used, cached, free in seen}
    return (f"{status}; {len(seen)} scrapes, {len(held)} with sequences held, {len(wrong)} of "
            f"them with no page used; used + cached + free: {sorted(sums)} (pool {t.pages})",
            status == 200 and held and not wrong and sums == {t.pages})


def run_threads(fn, n: int) -> None:
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)


# (input, expected, case)
CASES = [
    ("sequence model: lora_admin without the admin key (HTTP, gRPC)",
     "400 naming the key; adapters as they were", case_admin_without_the_key),
    ("sequence model: lora_admin load of a path holding a NUL", "400 naming U+0000",
     case_admin_nul_path),
    ("openai: load an adapter of rank 0", "400 naming it", case_adapter_rank_zero),
    ("openai: load an adapter whose lora_B is NaN", "400 naming NaN", case_adapter_nan),
    ("an adapter giving NaN logits used, unloaded; then 64 base-model streams",
     "its chats errors; 0 errors, solo ids after", case_nan_adapter_then_base_streams),
    ("sequence model: CACHE_SALT b'g\\0one' and b'g\\0two' (HTTP, gRPC)", "no block shared",
     case_binary_salts),
    ("generate: 20 schemas slow to compile, and a plain chat", "chat within 2x its time "
     "alone; none INTERNAL", case_grammar_compiles_beside_a_chat),
    ("openai: guided_regex Q{100} with max_tokens 1", "one Q, length; the prompt alone "
     "prefilled", case_forced_tokens_within_max_tokens),
    ("openai: stop_token_ids [1e9, -1], prompt [-1, 5], detokenize [49152]",
     "400 each naming the id", case_token_ids_out_of_range),
    ("openai: two n=16 completions whose clients give up after 1 s", "next request answered "
     "(no 429) 1 s later", case_gone_client_frees_its_choices),
    ("openai: prompt_logprobs 20 on a 512-token prompt beside chats (and on 513)",
     "chat's first token within 2x alone; 513 a 400", case_long_prompt_logprobs_beside_chats),
    ("metrics while an n=4 completion and the streams run", "pages used whenever sequences "
     "are held; the gauges add up to the pool", case_pages_used_while_sequences_held),
]


# ------------------------------------------------------------------ the target

def start_fault_target(artifact, work: Path, max_concurrent: int = 32, idle_s: float = 120.0):
    """SmolLM2 with adapter pools (`artifact`) served as MODEL and GENERATE in `work`/repo with
    adapters loadable from `work`/adapters (the cases' adapters written there), a host tier of
    16 pages, tritonserver and tlaloc openai with the admin key; TENANT loaded; the streams'
    prompts and solo ids. Returns (FaultTarget, stop)."""
    from triton_tlaloc.artifact.loading import load_artifact
    from triton_tlaloc.frontends.openai_server import ServedModel, ServerOptions, serve_in_thread
    from triton_tlaloc.kv.page_pools import FULL
    from triton_tlaloc.repository import RepositoryOptions, write_repository
    from triton_tlaloc.runtime.kv_transfer import page_bytes
    from triton_tlaloc.triton.server import TritonServer

    art = load_artifact(artifact)
    root = work / "adapters"
    for kind in ("small", "nan", "rank0", "overflow"):
        write_adapter(root / kind, kind)
    write_repository(artifact, work / "repo", MODEL, RepositoryOptions(
        max_sequence_idle_microseconds=int(idle_s * 1e6), lora_updates_root=str(root),
        host_kv_bytes=16 * page_bytes(art, FULL)))
    server = TritonServer(work / "repo", exit_timeout_s=3, admin_key=ADMIN_KEY).start()
    try:
        base, stop_openai = serve_in_thread(
            server.grpc_url, {MODEL: ServedModel.discover(server.grpc_url, MODEL)},
            options=ServerOptions(api_key=API_KEY, admin_key=ADMIN_KEY,
                                  max_concurrent=max_concurrent))
    except Exception:
        server.stop()
        raise
    t = FaultTarget(server, base, art.max_context, art.model.block_size, max_concurrent,
                    art.model.num_blocks - 1, Path(artifact), work, idle_s=idle_s,
                    updates_root=root)

    def stop():
        stop_openai()
        server.stop()
    try:
        status, text = admin_route(t, "load", {"lora_name": TENANT, "lora_path": "small"})
        assert status == 200, f"{TENANT} not loaded: {status} {text}"
        t.prompts = [[1] + [(k * 53 + i * 29) % 25000 + 400 for i in range(20 + 3 * k)]
                     for k in range(STREAMS)]
        t.solo = [stream(t, p).token_ids for p in t.prompts]
    except Exception:
        stop()
        raise
    return t, stop


__all__ = ["CASES", "EXPORT", "FaultTarget", "run_fault_case", "start_fault_target", "write_adapter"]

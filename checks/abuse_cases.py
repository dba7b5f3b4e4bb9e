"""What an attacker or a careless client tries against a served model, and what must happen.

Each case sends one kind of bad input (or a flood of it) to the sequence model, the generate
model, `tlaloc openai` or Triton's own APIs, and returns (observed, ok). `run_case` runs it while
a neighbour sequence decodes on the same model, then checks that the server is still ready and
that the neighbour's ids equal its solo run: a bad request must cost nothing but its own answer.
scripts/abuse.py prints the table (and runs the soak); tests/test_hardening.py asserts each row.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_tlaloc.frontends.client import (InferError, TlalocClient, generate, metric,
                                            new_sequence_id, scrape_metrics)

MODEL = "smollm2"
GENERATE = "smollm2_generate"
# The same artifact with a host tier of HOST_PAGES pages and as many sequence slots as pages.
TIGHT = "tight"
HOST_PAGES = 4
NAN = "nan_weights"  # the artifact with every attn_norm weight NaN
SERVED = "served"  # the model `tlaloc serve` runs for the process-fault cases
API_KEY = "abuse-test-key"
NEIGHBOUR_PROMPT = [1, 9690, 314, 260, 1953, 282]  # stays within one page with its steps
NEIGHBOUR_STEPS = 8
STORY = "Once upon a time, in a small village by the sea,"  # a prompt that goes on and on


@dataclass
class Target:
    server: object  # a started triton_tlaloc.triton.server.TritonServer serving MODEL and GENERATE
    openai: str  # `tlaloc openai`'s base URL, http://127.0.0.1:PORT/v1, key API_KEY
    max_context: int
    block_size: int  # tokens per KV page
    max_concurrent: int  # the OpenAI server's limit of generations in flight
    pages: int  # usable KV pages of each model's pool
    artifact: Path
    work: Path  # where the cases may write (the process-fault cases' repository and cache)
    neighbour_solo: list[int] | None = None
    serve: "ServeProcess | None" = None  # started by the first case that needs it
    idle_s: float = 60.0  # Triton ends MODEL's sequences idle this long

    @property
    def openai_host(self) -> tuple[str, int]:
        host, port = self.openai.split("//")[1].split("/")[0].split(":")
        return host, int(port)


# ------------------------------------------------------------------ helpers

def pages_used(t: Target) -> float:
    return metric(scrape_metrics(t.server.metrics_url), "tlaloc_kv_pages_used", model=MODEL)


def wait_pages(t: Target, at_most: float, within_s: float) -> float | None:
    """Seconds until MODEL's used pages fall to `at_most` (the metric lags up to 0.25 s, which
    this counts against the generation), or None if they did not within `within_s`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < within_s:
        if pages_used(t) <= at_most:
            return time.perf_counter() - t0
        time.sleep(0.05)
    return None


def seq_error(t: Target, tokens, *, protocol="http", start=True, seq_id=None, dtype=np.int32,
              name="TOKENS", parameters=None) -> tuple[str, str]:
    """(status, message) of one sequence-model request built by hand ("accepted" if none)."""
    url = t.server.http_url if protocol == "http" else t.server.grpc_url
    if protocol == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    arr = np.asarray(tokens, dtype=dtype).reshape(1, -1)
    inp = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr)
    client = mod.InferenceServerClient(url)
    sid = seq_id if seq_id is not None else new_sequence_id()
    try:
        client.infer(MODEL, [inp], outputs=[mod.InferRequestedOutput("ARGMAX")], sequence_id=sid,
                     sequence_start=start, sequence_end=False, parameters=parameters)
        with TlalocClient(url, MODEL, protocol) as c:
            c.request(sid, [], end=True, outputs=("ARGMAX",))
        return "accepted", ""
    except InferenceServerException as e:
        return str(e.status()), e.message()
    except Exception as e:  # the client library refused to send it
        return type(e).__name__, str(e)
    finally:
        client.close()


def openai_request(t: Target, path: str, body=None, *, headers=None, method="POST",
                   raw: bytes | None = None, key: str | None = API_KEY,
                   timeout: float = 60, root: str = "/v1") -> tuple[int, dict, str]:
    """(status, headers, body text) of one request to `tlaloc openai` (its routes under
    `root`; "" for /tokenize and /detokenize)."""
    host, port = t.openai_host
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        conn.request(method, f"{root}{path}", body=data, headers=h)
        r = conn.getresponse()
        headers = {k.lower(): v for k, v in r.getheaders()}
        return r.status, headers, r.read().decode(errors="replace")
    finally:
        conn.close()


def completion(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}


def _ok_status(want: int, got: tuple[int, dict, str], must_say: str = "") -> tuple[str, bool]:
    status, _, text = got
    ok = status == want and must_say.lower() in text.lower()
    return f"{status} {text[:90]}", ok


# ------------------------------------------------------------------ the sequence model

def case_token_outside_vocab(t):
    status, msg = seq_error(t, [1, 10**9])
    return f"{status} {msg[:90]}", "400" in status and "outside the vocabulary" in msg


def case_million_ids(t):
    t0 = time.perf_counter()
    status, msg = seq_error(t, np.ones(1_000_000, np.int32))
    s = time.perf_counter() - t0
    return (f"{status} in {s:.2f} s: {msg[:70]}",
            "400" in status and "more than the largest context" in msg and s < 2)


def case_float_tokens(t):
    status, msg = seq_error(t, [1.0, 2.0], dtype=np.float32)
    return f"{status} {msg[:90]}", "400" in status


def case_wrong_input_name(t):
    status, msg = seq_error(t, [1, 2], name="IDS")
    return f"{status} {msg[:90]}", "400" in status


def case_bad_top_k(t):
    status, msg = seq_error(t, [1, 2], parameters={"top_k": -3})
    return f"{status} {msg[:90]}", "400" in status and "top_k" in msg


def case_step_without_start(t):
    status, msg = seq_error(t, [5], start=False)
    return f"{status} {msg[:90]}", "400" in status


def case_sequence_id_2_64_over_http(t):
    """Triton's HTTP front end cannot parse the id and answers 500 itself: the request never
    reaches the model (nothing held, nothing touched)."""
    status, msg = seq_error(t, [1, 2], seq_id=2**64)
    return f"{status} {msg[:90]}", status in ("500", "400") and "sequence_id" in msg


@contextmanager
def full_pool(t: Target):
    """MODEL's pool filled by sequences of 99 tokens until one is refused: yields (the
    holders' ids, that refusal's status and message); the holders are ENDed on the way out."""
    holders, status, msg = [], "accepted", ""
    with TlalocClient(t.server.http_url, MODEL, "http") as c:
        try:
            while status == "accepted" and len(holders) < 64:
                sid = new_sequence_id()
                try:
                    c.request(sid, list(range(1, 100)), start=True, outputs=("ARGMAX",))
                    holders.append(sid)
                except InferError as e:
                    status, msg = str(e.status), str(e)
            yield holders, status, msg
        finally:
            for sid in holders:
                c.request(sid, [], end=True, outputs=("ARGMAX",))


def case_refusal_names_no_other_id(t):
    """The pool filled by holders; the refused START hears how many sequences hold pages,
    never their ids (with one, it could step or END another client's sequence)."""
    with full_pool(t) as (holders, status, msg):
        pass
    leaked = [sid for sid in holders if str(sid) in msg]
    return (f"{status}: {msg[-60:]}; {len(leaked)} of {len(holders)} holders' ids in it",
            "503" in status and "hold pages" in msg and not leaked and holders)


def case_refused_starts_do_not_hold_slots(t):
    """130 STARTs refused by the backend, never ENDed by their clients; then a normal
    sequence must be answered at once (not after Triton's idle timeout)."""
    with TlalocClient(t.server.grpc_url, MODEL, "grpc") as c:
        for _ in range(130):
            try:
                c.request(new_sequence_id(), [1, 10**9], start=True, outputs=("ARGMAX",))
            except InferError:
                pass
        t0 = time.perf_counter()
        g = c.generate_greedy([1, 2, 3], 2, argmax_output=True)
        s = time.perf_counter() - t0
    return f"next sequence answered in {s:.2f} s", s < 2 and len(g.generated_ids) == 2


# ------------------------------------------------------------------ the generate model

def _gen(t, sampling=None, **kw):
    return generate(t.server.grpc_url, GENERATE, sampling=sampling, **kw)


def _gen_refused(t, want_status: str, must_say: str, **kw) -> tuple[str, bool]:
    t0 = time.perf_counter()
    g = _gen(t, **kw)
    s = time.perf_counter() - t0
    return (f"{g.status} in {s:.2f} s: {(g.error or '')[:80]}",
            g.status == want_status and must_say in (g.error or "") and s < 5)


def case_generate_nan_temperature(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "temperature", input_ids=[1, 2],
                        sampling={"temperature": float("nan")})


def case_generate_list_temperature(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "temperature", input_ids=[1, 2],
                        sampling={"temperature": []})


def case_generate_tiny_temperature(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "temperature", input_ids=[1, 2],
                        sampling={"temperature": 1e-320})


def case_generate_negative_seed(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "seed", input_ids=[1, 2],
                        sampling={"temperature": 1, "seed": -1})


def case_generate_megabyte_stop_string(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "characters", text="Hello",
                        sampling={"stop": ["x" * 1_000_000]})


def case_generate_four_million_ids(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "largest context",
                        input_ids=np.ones(4_000_000, np.int32))


def case_generate_ten_megabyte_text(t):
    return _gen_refused(t, "INVALID_ARGUMENT", "characters", text="a" * 10_000_000)


def case_generate_refused_starts_are_ended(t):
    """130 generations whose START the sequence model refuses; the generate model ENDs each,
    so the next generation is answered at once."""
    for _ in range(130):
        _gen(t, input_ids=[1, 10**9], sampling={"max_tokens": 1})
    t0 = time.perf_counter()
    g = _gen(t, input_ids=[1, 2, 3], sampling={"max_tokens": 2})
    s = time.perf_counter() - t0
    return f"next generation in {s:.2f} s ({g.finish_reason})", s < 2 and g.error is None


def case_generate_full_pool_is_unavailable(t):
    """A full pool is UNAVAILABLE (retry later), not a bad request; the message names no
    holder."""
    with full_pool(t) as (holders, _, _):
        g = _gen(t, input_ids=list(range(1, 100)), sampling={"max_tokens": 2})
        status, _, text = openai_request(t, "/completions", completion(list(range(1, 100))))
    leaked = any(str(sid) in (g.error or "") + text for sid in holders)
    return (f"generate {g.status}; OpenAI {status}; holders' ids told: {leaked}",
            g.status == "UNAVAILABLE" and status == 503 and not leaked)


# ------------------------------------------------------------------ tlaloc openai

def case_openai_no_key(t):
    return _ok_status(401, openai_request(t, "/models", method="GET", key=None))


def case_openai_wrong_key(t):
    return _ok_status(401, openai_request(t, "/completions", completion("Hi"), key="guess"))


def case_openai_text_plain(t):
    """A web page can post text/plain without a CORS preflight: refused."""
    return _ok_status(415, openai_request(t, "/completions", completion("Hi"),
                                          headers={"Content-Type": "text/plain"}))


def case_openai_malformed_json(t):
    return _ok_status(400, openai_request(t, "/completions", raw=b'{"model": "smollm2", '))


def case_openai_wrong_types(t):
    got = [openai_request(t, "/completions", completion("Hi", max_tokens="abc"))[0],
           openai_request(t, "/completions", completion("Hi", temperature=[]))[0],
           openai_request(t, "/chat/completions", {"model": MODEL, "messages": "x"})[0],
           openai_request(t, "/completions", raw=b"[1, 2]")[0]]
    return f"{got}", got == [400] * 4


def case_openai_bad_sampling_values(t):
    got = [openai_request(t, "/completions", completion("Hi", temperature=1e-320))[0],
           openai_request(t, "/completions", completion("Hi", temperature=1, seed=-1))[0]]
    return f"{got}", got == [400, 400]


def _completions_head(framing: str) -> bytes:
    """The head of a POST /v1/completions written by hand, its body framed by `framing`
    ("Content-Length: N" or "Transfer-Encoding: chunked")."""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nAuthorization: Bearer {API_KEY}\r\n{framing}\r\n\r\n"
            ).encode()


def _send_completion(t: Target, body: dict) -> socket.socket:
    """A completion request sent on a socket of its own, nothing read; the socket is open."""
    data = json.dumps(body).encode()
    s = socket.create_connection(t.openai_host, timeout=30)
    s.sendall(_completions_head(f"Content-Length: {len(data)}") + data)
    return s


def _raw_http(t, head: bytes, body: bytes = b"") -> str:
    """The status line and headers of the answer to a request written by hand."""
    s = socket.create_connection(t.openai_host, timeout=30)
    try:
        s.sendall(head + body)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        return got.decode(errors="replace").split("\r\n\r\n")[0]
    finally:
        s.close()


def case_openai_body_too_large(t):
    """Refused on its Content-Length before a byte of it is read, and a chunked body as soon
    as it passes the limit (5 MB against 4 MiB)."""
    by_length = _raw_http(t, _completions_head("Content-Length: 5000000"))
    chunk = b"a" * 1_000_000
    chunked = _raw_http(t, _completions_head("Transfer-Encoding: chunked"),
                        b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5)))
    got = [by_length.split("\r\n")[0], chunked.split("\r\n")[0]]
    return f"{got}", all(" 413 " in g for g in got)


def case_openai_foreign_host(t):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    return _ok_status(400, openai_request(t, "/models", method="GET",
                                          headers={"Host": "evil.example"}))


def case_openai_no_cors_for_strangers(t):
    status, headers, _ = openai_request(t, "/models", method="GET",
                                        headers={"Origin": "http://evil.example"})
    allowed = headers.get("access-control-allow-origin")
    return f"{status}, access-control-allow-origin {allowed}", allowed is None


def case_openai_over_context(t):
    """130 prompts longer than the context (each 400), then a normal request at once."""
    long = list(range(1, t.max_context + 20))
    codes = {openai_request(t, "/completions", completion(long))[0] for _ in range(130)}
    t0 = time.perf_counter()
    status, _, _ = openai_request(t, "/completions", completion([1, 2, 3]))
    s = time.perf_counter() - t0
    return f"refused with {sorted(codes)}; next answered {status} in {s:.2f} s", \
        codes == {400} and status == 200 and s < 2


def _open_stream(t, max_tokens=100) -> socket.socket:
    """A streamed completion whose first event has arrived; the socket is left open."""
    s = _send_completion(t, completion(STORY, max_tokens=max_tokens, stream=True))
    got = b""
    while b"data:" not in got:
        chunk = s.recv(4096)
        if not chunk:
            raise RuntimeError(f"the stream ended before its first event: {got[:200]!r}")
        got += chunk
    return s


def _settled_pages(t: Target) -> float:
    """MODEL's used pages once the metric has caught up (it is written every 0.25 s)."""
    time.sleep(0.6)
    return pages_used(t)


def _wait_held(t: Target, base: float) -> None:
    """Until the metric shows a generation holding pages over `base`."""
    t0 = time.perf_counter()
    while pages_used(t) <= base and time.perf_counter() - t0 < 10:
        time.sleep(0.05)


def _freed_on_close(t: Target, s: socket.socket, base: float) -> tuple[str, bool]:
    """Closes `s` once its generation holds pages over `base`: how soon they came back."""
    _wait_held(t, base)
    s.close()
    freed = wait_pages(t, base, 3.0)
    return (f"pages back to {base:.0f} in {freed:.2f} s" if freed is not None else
            f"pages still {pages_used(t):.0f} after 3 s"), freed is not None and freed < 1.0


def case_openai_stream_disconnect_frees_pages(t):
    base = _settled_pages(t)
    return _freed_on_close(t, _open_stream(t), base)


def case_openai_request_disconnect_frees_pages(t):
    base = _settled_pages(t)
    return _freed_on_close(t, _send_completion(t, completion(STORY, max_tokens=100)), base)


def case_generate_salt_with_a_nul(t):
    """'g\\0one' and 'g\\0two' would be one salt past Triton (a NUL ends a parameter there)."""
    return _gen_refused(t, "INVALID_ARGUMENT", "U+0000", input_ids=[1, 2],
                        sampling={"cache_salt": "g\0one", "max_tokens": 1})


def case_client_salt_with_a_nul(t):
    try:
        with TlalocClient(t.server.grpc_url, MODEL) as c:
            c.generate_greedy([1, 2], 1, cache_salt="g\0one")
    except ValueError as e:
        return f"ValueError: {e}"[:120], "U+0000" in str(e)
    return "sent", False


def _chats(c: TlalocClient, chats: list[tuple[list[int], list[list[int]]]], steps: int):
    """Chats on one model in lockstep from one client: every START, then turn by turn each
    chat's request (its last id and the turn's tokens) and `steps` decode steps; the last
    request of each carries END. A chat whose START is refused drops out (None); returns each
    chat's ids after every request."""
    sids = [new_sequence_id() for _ in chats]
    ids: list[list[int] | None] = []
    for sid, (prompt, _) in zip(sids, chats):
        try:
            ids.append([int(c.request(sid, prompt, start=True, outputs=("ARGMAX",))
                            ["ARGMAX"][0])])
        except InferError:
            ids.append(None)
    turns = len(chats[0][1])
    for turn in range(turns):
        for step in range(steps + 1):
            for sid, (_, chat_turns), got in zip(sids, chats, ids):
                if got is None:
                    continue
                tokens = [got[-1]] + (chat_turns[turn] if step == 0 else [])
                last = turn == turns - 1 and step == steps
                got.append(int(c.request(sid, tokens, end=last, outputs=("ARGMAX",))
                               ["ARGMAX"][0]))
    return ids


def case_full_host_tier_serves_admitted_chats(t):
    """More chats than the pool and a host tier of HOST_PAGES pages hold once they grow: the
    sequences idle between turns give up their KV (computed again on their next turn), so
    every chat admitted finishes with its solo ids; only STARTs may be refused."""
    bs = t.block_size
    chats = [([1] + [(k * 131 + i * 17) % 4000 + 100 for i in range(2 * bs - 4)],
              [[(k * 53 + turn * 7 + i) % 4000 + 100 for i in range(bs - 3)]
               for turn in range(2)]) for k in range(t.pages // 2 + 2)]
    before = metric(scrape_metrics(t.server.metrics_url), "tlaloc_kv_recomputes_total",
                    model=TIGHT) or 0
    with TlalocClient(t.server.grpc_url, TIGHT, "grpc") as c:
        together = _chats(c, chats, steps=1)
    with TlalocClient(t.server.grpc_url, MODEL, "grpc") as c:
        solo = [_chats(c, [chat], steps=1)[0] if got is not None else None
                for chat, got in zip(chats, together)]
    recomputed = (metric(scrape_metrics(t.server.metrics_url, settle_s=0.6),
                         "tlaloc_kv_recomputes_total", model=TIGHT) or 0) - before
    admitted = sum(got is not None for got in together)
    return (f"{admitted} of {len(chats)} chats admitted, all equal solo: {together == solo}; "
            f"{recomputed:.0f} sequences computed again",
            admitted >= t.pages // 2 and together == solo and recomputed > 0)


def case_openai_content_parts_and_roles(t):
    """Text parts are joined; an image part and an unknown role are refused by name."""
    def chat(messages):
        return openai_request(t, "/chat/completions", {"model": MODEL, "messages": messages,
                                                       "max_tokens": 2, "temperature": 0})
    parts = chat([{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                               {"type": "text", "text": "there"}]}])
    image = chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    role = chat([{"role": "narrator", "content": "Hi"}])
    got = [parts[0], image[0], role[0]]
    ok = got == [200, 400, 400] and "image_url" in image[2] and "narrator" in role[2]
    return f"{got} {image[2][:60]} {role[2][:60]}", ok


def case_openai_slow_headers(t):
    """slowloris: a request's headers a byte a second; closed at the header deadline (10 s)."""
    s = socket.create_connection(t.openai_host, timeout=30)
    t0 = time.monotonic()
    closed = None
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 60:
            try:
                s.sendall(bytes([byte]))
                s.settimeout(1.0)
                if s.recv(1) == b"":
                    closed = time.monotonic() - t0
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = time.monotonic() - t0
                break
    finally:
        s.close()
    return (f"closed after {closed:.1f} s" if closed else "never closed"), \
        closed is not None and closed < 15


def case_openai_concurrency_limit(t):
    streams = []
    try:
        for _ in range(t.max_concurrent):
            streams.append(_open_stream(t, max_tokens=40))
        status, headers, _ = openai_request(t, "/completions", completion("Hi"))
    finally:
        for s in streams:
            s.close()
    return (f"{status} with {len(streams)} in flight, retry-after "
            f"{headers.get('retry-after')}", status == 429)


# ------------------------------------------------------------------ faults

def case_nonfinite_logits(t):
    """A model whose weights hold NaN (every attn_norm), asked through the sequence model and
    through the generate model with top-k/top-p sampling (which used to raise in the sampler and
    never answer): each gets one INTERNAL error naming NaN, its pages are freed and the rows are
    counted."""
    base = metric(scrape_metrics(t.server.metrics_url), "tlaloc_kv_pages_used", model=NAN)
    sid = new_sequence_id()
    with TlalocClient(t.server.grpc_url, NAN, "grpc") as c:
        try:
            c.request(sid, NEIGHBOUR_PROMPT, start=True, outputs=("ARGMAX",))
            seq = "answered"
        except InferError as e:
            seq = str(e)
        c.request(sid, [], end=True, outputs=("ARGMAX",))  # a refused step leaves it open
    g = generate(t.server.grpc_url, f"{NAN}_generate", input_ids=NEIGHBOUR_PROMPT, timeout_s=30,
                 sampling={"max_tokens": 4, "temperature": 0.8, "top_k": 20, "top_p": 0.9})
    seen = scrape_metrics(t.server.metrics_url, settle_s=0.6)
    counted = metric(seen, "tlaloc_nonfinite_logits_total", model=NAN, kind="prefill") or 0
    pages = metric(seen, "tlaloc_kv_pages_used", model=NAN)
    return (f"sequence model: {seq[:70]}; generate: {g.status} {str(g.error)[:60]}; "
            f"{counted:.0f} rows counted; pages {base:.0f} -> {pages:.0f}",
            "NaN" in seq and g.status == "INTERNAL" and "NaN" in (g.error or "")
            and counted >= 2 and pages == base)


UNREAD_TOKENS = 90  # with the prompt, 6 pages of 16 tokens (the neighbour holds one more)


def case_unread_stream(t):
    """A gRPC generation whose client stops reading after its first response: Triton buffers
    the responses without bound and gives the model no signal, so the generation runs to its
    max_tokens and then frees its pages (a bound per request, not a pause); the client reads
    every token when it reads again."""
    base = _settled_pages(t)
    stalled, resume, out = threading.Event(), threading.Event(), {}

    def stall(_piece):
        if not stalled.is_set():
            stalled.set()
            resume.wait(60)
    reader = threading.Thread(target=lambda: out.update(g=generate(
        t.server.grpc_url, GENERATE, input_ids=NEIGHBOUR_PROMPT, on_text=stall,
        sampling={"max_tokens": UNREAD_TOKENS, "ignore_eos": True})))
    reader.start()
    try:
        stalled.wait(60)
        _wait_held(t, base)
        held = pages_used(t) - base
        freed = wait_pages(t, base, 60)
    finally:
        resume.set()
        reader.join(120)
    g = out.get("g")
    if g is None:
        return "the stalled client never got its result", False
    read = f"read {len(g.token_ids)} tokens, finish {g.finish_reason} {g.error or ''}"
    if freed is None:
        return f"pages still held after 60 s; then {read}", False
    return (f"{held:.0f} pages held while the reader stalled, freed {freed:.1f} s later; then "
            f"{read}", held > 0 and len(g.token_ids) == UNREAD_TOKENS
            and g.finish_reason == "length")


def case_damaged_compile_cache(t):
    """`tlaloc serve` started on a copy of the compile cache with 4 KiB flipped in the middle of
    every file (PJRT would load such bytes, and the first call could kill the process): each
    file refused by its checksum and compiled again, the model ready and serving solo ids."""
    p = served(t)
    refused = p.first_log.count("refused (checksum mismatch")
    deaths = p.out.read_text(errors="replace").count("died")
    with TlalocClient(p.grpc_url, SERVED, "grpc") as c:
        ids = c.generate_greedy(NEIGHBOUR_PROMPT, NEIGHBOUR_STEPS,
                                argmax_output=True).generated_ids
    died = p.out.read_text(errors="replace").count("died") > deaths
    return (f"{refused} cache files refused and compiled again; ids equal solo: "
            f"{ids == t.neighbour_solo}; a model process died: {died}",
            refused > 0 and ids == t.neighbour_solo and not died)


def case_model_process_killed(t):
    """Each model process (the sequence model's, then the generate model's) SIGKILLed while a
    generation streams, under `tlaloc serve`: Triton alone would keep the model ready and never
    answer. The in-flight stream ends with an error, `tlaloc serve` restarts the server, and
    both models are back within a minute with solo ids."""
    from triton_tlaloc.triton.server import processes_named, stub_processes

    p = served(t)
    seen = []
    for restarts, model in enumerate((SERVED, f"{SERVED}_generate"), start=1):
        server_pid, = processes_named("tritonserver", parent=p.proc.pid)
        stub = next(s for s in stub_processes(server_pid) if s.model == model)
        first, ended = threading.Event(), {}
        streaming = threading.Thread(target=lambda: ended.update(g=generate(
            p.grpc_url, f"{SERVED}_generate", input_ids=NEIGHBOUR_PROMPT, timeout_s=60,
            on_text=lambda _: first.set(), sampling={"max_tokens": 100, "ignore_eos": True})))
        streaming.start()
        if not first.wait(60):
            return f"{model}: the generation sent nothing", False
        killed = time.monotonic()
        os.kill(stub.pid, signal.SIGKILL)
        streaming.join(30)
        ended_s, g = time.monotonic() - killed, ended.get("g")
        if streaming.is_alive() or g is None or g.error is None:
            return (f"{model} killed: the in-flight stream "
                    f"{'hung' if g is None else 'ended without an error'}"), False
        back = p.wait_for("ready: HTTP", restarts + 1, 60)
        if back is None:
            return f"{model} killed: not ready again within 60 s", False
        with TlalocClient(p.grpc_url, SERVED, "grpc") as c:
            ids = c.generate_greedy(NEIGHBOUR_PROMPT, NEIGHBOUR_STEPS,
                                    argmax_output=True).generated_ids
        g = generate(p.grpc_url, f"{SERVED}_generate", input_ids=NEIGHBOUR_PROMPT,
                     sampling={"max_tokens": NEIGHBOUR_STEPS, "ignore_eos": True})
        if ids != t.neighbour_solo or g.token_ids != t.neighbour_solo:
            return f"{model} killed: ids after the restart differ from solo", False
        seen.append(f"{model} killed: stream ended in {ended_s:.1f} s, served again in "
                    f"{time.monotonic() - killed:.0f} s")
    text = p.out.read_text(errors="replace")
    return "; ".join(seen), "restarting tritonserver (2 of at most 3)" in text


# ------------------------------------------------------------------ Triton's own APIs

def triton_post(http_url: str, path: str, body, headers: dict | None = None) -> int:
    """The HTTP status of a JSON POST to tritonserver at `http_url`."""
    req = urllib.request.Request(f"http://{http_url}{path}", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def case_triton_logging_closed(t):
    status = triton_post(t.server.http_url, "/v2/logging", {"log_verbose_level": 1})
    return f"{status}", status == 403


def case_triton_repository_closed(t):
    status = triton_post(t.server.http_url, f"/v2/repository/models/{MODEL}/unload", {})
    return f"{status}", status == 403


# (input, expected, case); the neighbour decodes on MODEL during each.
CASES = [
    ("sequence model: token id 10^9", "400 naming the id", case_token_outside_vocab),
    ("sequence model: 1M token ids", "400 before any work (< 2 s)", case_million_ids),
    ("sequence model: FP32 TOKENS", "400 from Triton", case_float_tokens),
    ("sequence model: input IDS instead of TOKENS", "400 from Triton", case_wrong_input_name),
    ("sequence model: top_k -3", "400 naming top_k", case_bad_top_k),
    ("sequence model: a step on an id never started", "400", case_step_without_start),
    ("sequence model: sequence id 2^64 over HTTP", "Triton's own 500, nothing reached",
     case_sequence_id_2_64_over_http),
    ("sequence model: START into a full pool", "503 naming no other id",
     case_refusal_names_no_other_id),
    ("sequence model: 130 refused STARTs never ENDed, then a sequence",
     "answered in < 2 s", case_refused_starts_do_not_hold_slots),
    ("generate: temperature NaN", "INVALID_ARGUMENT naming it", case_generate_nan_temperature),
    ("generate: temperature []", "INVALID_ARGUMENT naming it", case_generate_list_temperature),
    ("generate: temperature 1e-320", "INVALID_ARGUMENT naming it",
     case_generate_tiny_temperature),
    ("generate: seed -1", "INVALID_ARGUMENT naming it", case_generate_negative_seed),
    ("generate: a 1 MB stop string", "INVALID_ARGUMENT at once",
     case_generate_megabyte_stop_string),
    ("generate: 4M input ids", "INVALID_ARGUMENT at once", case_generate_four_million_ids),
    ("generate: 10 MB text_input", "INVALID_ARGUMENT at once", case_generate_ten_megabyte_text),
    ("generate: 130 refused STARTs, then a generation", "answered in < 2 s",
     case_generate_refused_starts_are_ended),
    ("generate and OpenAI: a full pool", "UNAVAILABLE / 503, no holder named",
     case_generate_full_pool_is_unavailable),
    ("openai: no API key", "401", case_openai_no_key),
    ("openai: wrong API key", "401", case_openai_wrong_key),
    ("openai: text/plain body", "415", case_openai_text_plain),
    ("openai: malformed JSON", "400", case_openai_malformed_json),
    ("openai: wrong types (max_tokens 'abc', temperature [], messages 'x', a list)",
     "400 each", case_openai_wrong_types),
    ("openai: temperature 1e-320, seed -1", "400 each", case_openai_bad_sampling_values),
    ("openai: 5 MB body, by Content-Length and chunked", "413 each",
     case_openai_body_too_large),
    ("openai: Host evil.example", "400", case_openai_foreign_host),
    ("openai: Origin evil.example", "no CORS header", case_openai_no_cors_for_strangers),
    ("openai: 130 prompts over the context, then a request", "400 each; next in < 2 s",
     case_openai_over_context),
    ("openai: streamed client disconnects", "pages freed in < 1 s",
     case_openai_stream_disconnect_frees_pages),
    ("openai: waiting client disconnects", "pages freed in < 1 s",
     case_openai_request_disconnect_frees_pages),
    ("openai: one generation over the concurrency limit", "429", case_openai_concurrency_limit),
    ("generate: cache_salt 'g\\0one'", "INVALID_ARGUMENT naming U+0000",
     case_generate_salt_with_a_nul),
    ("sequence model client: cache_salt 'g\\0one'", "refused before sending",
     case_client_salt_with_a_nul),
    ("openai: text parts, an image part, role narrator", "200, 400, 400 naming them",
     case_openai_content_parts_and_roles),
    ("openai: headers sent a byte a second (slowloris)", "closed within 15 s",
     case_openai_slow_headers),
    ("sequence model: chats outgrowing the pool and a full host tier",
     "admitted chats all finish, solo ids", case_full_host_tier_serves_admitted_chats),
    ("sequence and generate models: weights that give NaN logits, top-k/top-p sampling",
     "INTERNAL naming NaN, pages freed, counted", case_nonfinite_logits),
    ("generate: a gRPC stream whose reader stalls", "runs to max_tokens, pages freed; all read",
     case_unread_stream),
    ("tlaloc serve: 4 KiB flipped in every compile cache file",
     "each refused and compiled again; solo ids", case_damaged_compile_cache),
    ("tlaloc serve: each model process SIGKILLed mid-generation",
     "stream ends with an error; back < 60 s, solo ids", case_model_process_killed),
    ("triton: POST /v2/logging without the admin key", "403", case_triton_logging_closed),
    ("triton: unload a model without the admin key", "403", case_triton_repository_closed),
]


# ------------------------------------------------------------------ `tlaloc serve`

class ServeProcess:
    """`tlaloc serve` of the target's artifact as SERVED (and SERVED_generate) on ports of its
    own, its compile cache a copy of the suite's with 4 KiB flipped in the middle of every file;
    tritonserver's log in `log`, `tlaloc serve`'s output in `out`."""

    def __init__(self, t: Target):
        from triton_tlaloc.runtime.compile_cache import default_cache_dir
        from triton_tlaloc.repository import RepositoryOptions, write_repository
        from triton_tlaloc.triton.server import free_ports

        work = t.work / "served"
        shutil.rmtree(work, ignore_errors=True)
        damaged = work / "damaged-cache"
        damaged.mkdir(parents=True)
        for f in default_cache_dir().glob("*.pjrt"):
            data = bytearray(f.read_bytes())
            mid = len(data) // 2
            data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
            (damaged / f.name).write_bytes(data)
        write_repository(t.artifact, work / "repo", SERVED,
                         RepositoryOptions(compile_cache_dir=str(damaged)))
        ports = free_ports(3)
        self.grpc_url = f"127.0.0.1:{ports[1]}"
        self.out, self.log = work / "serve.out", work / "tritonserver.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "triton_tlaloc.cli", "serve", str(work / "repo"),
             "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
             "--metrics-port", str(ports[2]), "--exit-timeout", "3",
             "--log-file", str(self.log)],
            stdout=open(self.out, "wb"), stderr=subprocess.STDOUT)
        if self.wait_for("ready: HTTP", 1, 300) is None:
            self.stop()
            raise RuntimeError(f"tlaloc serve not ready: {self.out.read_text()[-2000:]}")
        self.first_log = self.log.read_text(errors="replace")

    def wait_for(self, text: str, count: int, within_s: float) -> float | None:
        """Seconds until `tlaloc serve` has printed `text` `count` times, or None."""
        t0 = time.monotonic()
        while self.out.read_text(errors="replace").count(text) < count:
            if time.monotonic() - t0 > within_s or self.proc.poll() is not None:
                return None
            time.sleep(0.2)
        return time.monotonic() - t0

    def stop(self) -> int | None:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def served(t: Target) -> ServeProcess:
    if t.serve is None:
        t.serve = ServeProcess(t)
    return t.serve


# ------------------------------------------------------------------ running a case

def neighbour_solo(t: Target) -> list[int]:
    with TlalocClient(t.server.http_url, MODEL, "http") as c:
        return c.generate_greedy(NEIGHBOUR_PROMPT, NEIGHBOUR_STEPS,
                                 argmax_output=True).generated_ids


class Neighbour:
    """A sequence started before a case and decoded on a thread of its own while the case runs
    (NEIGHBOUR_STEPS ids; it holds its page until the case ends). tritonclient's HTTP client
    must stay on the thread that made it: the thread does everything."""

    def __init__(self, t: Target):
        self.t = t
        self.ids: list[int] = []
        self.error: Exception | None = None
        self.started, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.started.wait(60)

    def _run(self):
        sid = new_sequence_id()
        try:
            with TlalocClient(self.t.server.http_url, MODEL, "http") as c:
                last = time.monotonic()
                try:
                    out = c.request(sid, NEIGHBOUR_PROMPT, start=True, outputs=("ARGMAX",))
                    self.ids.append(int(out["ARGMAX"][0]))
                    self.started.set()
                    while len(self.ids) < NEIGHBOUR_STEPS:
                        out = c.request(sid, [self.ids[-1]], outputs=("ARGMAX",))
                        self.ids.append(int(out["ARGMAX"][0]))
                    last = time.monotonic()
                    self.done.wait(300)
                finally:
                    try:
                        c.request(sid, [], end=True, outputs=("ARGMAX",))
                    except InferError:
                        # A case that ran longer than Triton's idle timeout: Triton ended the
                        # idle sequence itself, and the END finds none ("must specify the
                        # START flag"). Before that timeout, a refused END is a failure.
                        if time.monotonic() - last < self.t.idle_s:
                            raise
        except Exception as e:  # reported in the row
            self.error = e
        finally:
            self.started.set()

    def finish(self) -> list[int]:
        self.done.set()
        self.thread.join(120)
        if self.error is not None:
            raise self.error
        return self.ids


def run_case(t: Target, fn) -> dict:
    """One case with a neighbour: {observed, ok, ready, neighbour_equal}."""
    if t.neighbour_solo is None:
        t.neighbour_solo = neighbour_solo(t)
    neighbour = Neighbour(t)
    try:
        observed, ok = fn(t)
    except Exception as e:
        observed, ok = f"{type(e).__name__}: {e}", False
    try:
        equal = neighbour.finish() == t.neighbour_solo
    except Exception as e:
        equal = False
        observed += f"; neighbour failed: {type(e).__name__}: {e}"
    return {"observed": observed, "ok": bool(ok), "ready": t.server.ready(),
            "neighbour_equal": equal}


# ------------------------------------------------------------------ the target

def start_target(artifact, repo, max_concurrent: int = 2, idle_s: float = 60.0):
    """MODEL and GENERATE from `artifact` in `repo` (Triton ending sequences idle `idle_s`),
    TIGHT (a host tier of HOST_PAGES pages, a sequence slot a page) and NAN (NaN weights) of
    the same artifact, a tritonserver and `tlaloc openai` (key API_KEY, `max_concurrent`
    generations): returns (Target, a function that stops them and any `tlaloc serve`)."""
    from triton_tlaloc.frontends.openai_server import ServedModel, ServerOptions, serve_in_thread
    from triton_tlaloc.runtime.kv_transfer import page_bytes
    from triton_tlaloc.kv.page_pools import FULL
    from triton_tlaloc.artifact.loading import load_artifact
    from triton_tlaloc.repository import RepositoryOptions, write_repository
    from triton_tlaloc.triton.server import TritonServer

    art = load_artifact(artifact)
    pages = art.model.num_blocks - 1
    # No host tier: the full-pool cases are of refusals, answered at once.
    write_repository(artifact, repo, MODEL, RepositoryOptions(
        max_sequence_idle_microseconds=int(idle_s * 1e6), host_kv_bytes=0))
    write_repository(artifact, repo, TIGHT, RepositoryOptions(
        sequence_slots=pages, host_kv_bytes=HOST_PAGES * page_bytes(art, FULL)))
    write_repository(nan_copy(artifact, Path(repo).parent / f"{Path(artifact).name}-nan"),
                     repo, NAN, RepositoryOptions(host_kv_bytes=0))
    # Every entry compiled first: several cases time what a steady server does (pages freed
    # within a second of a disconnect), which compiles beside them slowed past their bounds
    server = TritonServer(repo, exit_timeout_s=3).start()
    try:
        base, stop_openai = serve_in_thread(
            server.grpc_url, {MODEL: ServedModel.discover(server.grpc_url, MODEL)},
            options=ServerOptions(api_key=API_KEY, max_concurrent=max_concurrent))
    except Exception:
        server.stop()
        raise

    target = Target(server, base, art.max_context, art.model.block_size, max_concurrent, pages,
                    Path(artifact), Path(repo).parent, idle_s=idle_s)

    def stop():
        if target.serve is not None:
            target.serve.stop()
        stop_openai()
        server.stop()
    return target, stop


def nan_copy(artifact, dest: Path) -> Path:
    """`artifact` with every attn_norm weight NaN (the rest linked): its logits are NaN."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(artifact, dest, copy_function=os.link)
    manifest = json.loads((dest / "tlaloc-serving.json").read_text())
    for w in manifest["weights"]:
        if w["slot"].endswith("attn_norm"):
            assert w["dtype"] == "f32", w
            (dest / w["file"]).unlink()  # a link to the original: never written through
            (dest / w["file"]).write_bytes(np.full(w["byteLength"] // 4, np.nan, np.float32)
                                           .tobytes())
    return dest

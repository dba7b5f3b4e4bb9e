"""A client for a served Tlaloc model, over tritonclient's HTTP or gRPC API.

A sequence is a correlation id: the prompt goes with START, each later request carries one
token, and END (here on a request with no tokens, which runs nothing) frees the sequence's pages.
Sampling is the client's: `generate_greedy` takes the argmax of each step's logits.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

import numpy as np

from ..codes import GRPC_STATUS, split_coded_message
from ..generation.parameters import checked_cache_salt
from ..generation.drafting import prompt_lookup


class InferError(RuntimeError):
    """A request the server refused or failed; `status` is the HTTP or gRPC status text."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Generation:
    prompt_ids: list[int]
    generated_ids: list[int]
    prefill_ms: float
    step_ms: list[float]
    finish_reason: str

    @property
    def ms_per_token(self) -> float:
        return float(np.median(self.step_ms)) if self.step_ms else 0.0


# Triton's integer correlation ids are uint64, but tritonclient's gRPC client sends them as an
# int64 parameter: 2**63 - 1 is the largest id both protocols carry.
MAX_SEQUENCE_ID = 2**63 - 1
# Sent with every request of a sequence (its correlation id): behind replicas, a load balancer
# hashing on it keeps the sequence on the replica holding its KV (docs/scaling.md).
SESSION_HEADER = "x-tlaloc-session"


def new_sequence_id() -> int:
    """A fresh random correlation id in [1, 2**63) (0 is "no sequence"). A correlation id is
    the only thing that gives a request its sequence, so it must be unguessable: drawn from the
    operating system's random source, 63 random bits."""
    return secrets.randbelow(MAX_SEQUENCE_ID) + 1


class TlalocClient:
    def __init__(self, url: str, model: str, protocol: str = "grpc", timeout_s: float = 120.0):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol {protocol!r}: expected grpc or http")
        self.protocol, self.url = protocol, url
        self.model = model
        self.timeout_s = timeout_s
        if protocol == "grpc":
            import tritonclient.grpc as mod
            from tritonclient.utils import InferenceServerException

            self._client = mod.InferenceServerClient(url)
        else:
            import tritonclient.http as mod
            from tritonclient.utils import InferenceServerException

            self._client = mod.InferenceServerClient(url, network_timeout=timeout_s,
                                                     connection_timeout=timeout_s)
        self._mod = mod
        self._exc = InferenceServerException

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def model_parameters(self) -> dict[str, str]:
        cfg = self._client.get_model_config(self.model)
        if self.protocol == "grpc":
            return {k: v.string_value for k, v in cfg.config.parameters.items()}
        return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}

    def inference_statistics(self) -> dict[str, tuple[int, int]]:
        """Triton's cumulative statistics of the model: {"queue": (count, ns), "compute_input",
        "compute_infer", "compute_output", "success"}."""
        if self.protocol == "grpc":
            stats = self._client.get_inference_statistics(self.model, as_json=True)
        else:
            stats = self._client.get_inference_statistics(self.model)
        inference = stats["model_stats"][0]["inference_stats"]
        return {k: (int(v.get("count", 0)), int(v.get("ns", 0))) for k, v in inference.items()
                if k in ("success", "queue", "compute_input", "compute_infer", "compute_output")}

    def request(self, seq_id, tokens, *, start: bool = False, end: bool = False,
                outputs=("LOGITS",), top_k: int | None = None,
                cache_salt: str | bytes | None = None, draft_tokens: int = 0,
                lora: str | None = None, admin: dict | None = None,
                admin_key: str | None = None) -> dict[str, np.ndarray]:
        """One request asking for `outputs` (LOGITS, KV_PAGES, ARGMAX, TOP_K_IDS,
        TOP_K_LOGPROBS, ACCEPTED_IDS); returns those the response holds, each flattened. top_k:
        the request parameter K of the TOP_K outputs (the server's default is 8). draft_tokens:
        the last this many of `tokens` are drafts, verified in one call (ACCEPTED_IDS: those
        accepted, then the model's own next token). cache_salt: a string (the parameter), or bytes
        (the CACHE_SALT input: any bytes, NUL included). lora: a START's LoRA adapter by name;
        admin: an adapter load or unload (the parameter lora_admin, sent as its JSON), obeyed
        only with the server's admin key `admin_key`."""
        mod = self._mod
        arr = np.asarray(tokens, dtype=np.int32).reshape(1, -1)
        inp = mod.InferInput("TOKENS", list(arr.shape), "INT32")
        inp.set_data_from_numpy(arr)
        inputs = [inp]
        if isinstance(cache_salt, bytes):
            salt = mod.InferInput("CACHE_SALT", [1, 1], "BYTES")
            salt.set_data_from_numpy(np.array([[cache_salt]], dtype=np.object_))
            inputs.append(salt)
            cache_salt = None
        # Checked here, whole: past Triton a NUL would end the salt (generation/parameters.py).
        checked_cache_salt(cache_salt, "TlalocClient")
        kw = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        parameters = {**({"top_k": int(top_k)} if top_k is not None else {}),
                      **({"cache_salt": cache_salt} if cache_salt is not None else {}),
                      **({"draft_tokens": int(draft_tokens)} if draft_tokens else {}),
                      **({"lora": lora} if lora is not None else {}),
                      **({"lora_admin": json.dumps(admin)} if admin is not None else {}),
                      **({"lora_admin_key": admin_key} if admin_key is not None else {})}
        if parameters:
            kw["parameters"] = parameters
        try:
            res = self._client.infer(self.model, inputs,
                                     outputs=[mod.InferRequestedOutput(n) for n in outputs],
                                     sequence_id=seq_id, sequence_start=start,
                                     sequence_end=end, headers={SESSION_HEADER: str(seq_id)},
                                     **kw)
        except self._exc as e:
            raise InferError(e.message() if hasattr(e, "message") else str(e),
                             e.status() if hasattr(e, "status") else None) from None
        got = {n: res.as_numpy(n) for n in outputs}
        return {n: a.reshape(-1) for n, a in got.items() if a is not None}

    def infer(self, seq_id, tokens, *, start: bool = False, end: bool = False,
              want_pages: bool = False) -> tuple[np.ndarray | None, np.ndarray | None]:
        """One request; returns (logits [vocab] or None, KV_PAGES [2] or None)."""
        out = self.request(seq_id, tokens, start=start, end=end,
                           outputs=("LOGITS", "KV_PAGES") if want_pages else ("LOGITS",))
        return out.get("LOGITS"), out.get("KV_PAGES")

    def generate(self, prompt_ids: list[int], sampling: dict | None = None, *,
                 structured_output: dict | None = None, stream: bool = True
                 ) -> "GenerateResult":
        """One generation by the generate model beside this sequence model (NAME_generate:
        its loop runs on the server), `sampling` its sampling parameters; structured_output:
        a constraint the answer keeps to ({"json_schema": {...}}, {"json_object": true},
        {"regex": "..."}, {"choice": [...]} or {"grammar": "..."}). InferError (with the status
        name) when it is refused."""
        sampling = {**(sampling or {}),
                    **({"structured_output": structured_output} if structured_output else {})}
        send = generate if self.protocol == "grpc" else generate_http
        got = send(self.url, f"{self.model}_generate", input_ids=list(prompt_ids),
                   sampling=sampling, stream=stream, timeout_s=self.timeout_s)
        if got.error is not None:
            raise InferError(got.error, got.status)
        return got

    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                        stop_ids: tuple[int, ...] = (), seq_id=None,
                        argmax_output: bool = False,
                        cache_salt: str | bytes | None = None, speculate: int = 0,
                        drafter=prompt_lookup, lora: str | None = None) -> Generation:
        """Greedy ids chosen on the client from each step's LOGITS, or with argmax_output from
        the server's ARGMAX (4 bytes a step instead of the vocabulary's logits). cache_salt: the
        START's (prompts of different salts share no cached KV). speculate: up to this many
        drafts a step from `drafter(history, k)` (prompt lookup by default), verified by the
        server in one call; the ids are the same, in fewer steps when drafts are accepted.
        lora: the sequence's LoRA adapter by name (the START's)."""
        seq_id = seq_id if seq_id is not None else new_sequence_id()
        outputs = ("ARGMAX",) if argmax_output else ("LOGITS",)

        def next_token(out):
            return int(out["ARGMAX"][0]) if argmax_output else int(np.argmax(out["LOGITS"]))

        ended = False
        try:
            t0 = time.perf_counter()
            out = self.request(seq_id, prompt_ids, start=True, outputs=outputs,
                               cache_salt=cache_salt, lora=lora)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            ids, step_ms, reason = [next_token(out)], [], "length"
            while True:
                stopped = next((i for i, t in enumerate(ids) if t in stop_ids), None)
                if stopped is not None:
                    del ids[stopped + 1:]
                    reason = "stop"
                    break
                if len(ids) >= max_new_tokens:
                    del ids[max_new_tokens:]
                    break
                k = min(speculate, max_new_tokens - len(ids) - 1)
                drafts = drafter(list(prompt_ids) + ids, k) if k > 0 else []
                t0 = time.perf_counter()
                if drafts:
                    out = self.request(seq_id, [ids[-1]] + drafts, outputs=("ACCEPTED_IDS",),
                                       draft_tokens=len(drafts))
                    ids += out["ACCEPTED_IDS"].tolist()
                else:
                    out = self.request(seq_id, [ids[-1]], outputs=outputs)
                    ids.append(next_token(out))
                step_ms.append((time.perf_counter() - t0) * 1e3)
            self.infer(seq_id, [], end=True)
            ended = True
            return Generation(list(prompt_ids), ids, prefill_ms, step_ms, reason)
        finally:
            if not ended:
                try:  # free the pages of a sequence left half way
                    self.infer(seq_id, [], end=True)
                except InferError:
                    pass


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    responses: int  # responses received, the final one included
    first_token_ms: float | None  # request sent to the first response with text or ids
    error: str | None = None
    # The error's gRPC status name (INVALID_ARGUMENT: a bad request; UNAVAILABLE: the server
    # is full or unloading; CANCELLED; INTERNAL), as the generate model answered it.
    status: str | None = None
    # With sampling parameter logprobs: a [log-probability, [[id, log-probability], ...]]
    # for each of token_ids
    logprobs: list | None = None
    # With sampling parameter prompt_logprobs: the same for each prompt token (None for the
    # first, which follows nothing)
    prompt_logprobs: list | None = None


class Piece(str):
    """A response's new text, as on_text gets it, with the ids and log-probabilities of the
    tokens that came with it (`logprobs` None unless asked for), and on the first, the
    prompt's (`prompt_logprobs`, when asked for)."""
    token_ids: list[int] = []
    logprobs: list | None = None
    prompt_logprobs: list | None = None


# How often a generation waiting for its next response looks at its `cancel` event.
CANCEL_POLL_S = 0.05


def _status_name(err, message: str) -> str | None:
    """An error's gRPC status name: the exception's, or on a stream (whose errors carry only a
    message) the code the generate model names in brackets at the message's start."""
    status = err.status() if hasattr(err, "status") else None
    if status is not None:
        return str(status).rsplit(".", 1)[-1]
    code, _ = split_coded_message(message)
    return None if code is None else GRPC_STATUS[code]


def next_response(responses, cancelled, timeout_s: float, model: str, t0: float,
                  count: int, clock=time.perf_counter):
    """The next (result, error) a generate stream's callback queued on `responses`, looking at
    `cancelled()` every CANCEL_POLL_S meanwhile (None: it was set); TimeoutError when none has
    come `timeout_s` after this call (t0: when the request was sent; count: responses so far).
    The wait is read from the clock, not counted in polls: a busy process returns from each
    get later than asked, and counting them let a 120 s limit run for 248 s."""
    import queue

    since = clock()
    while True:
        try:
            return responses.get(timeout=CANCEL_POLL_S)
        except queue.Empty:
            if cancelled():
                return None
            now = clock()
            if now - since >= timeout_s:
                after = "its last response" if count else "it was sent"
                raise TimeoutError(
                    f"{model}: no response in {now - since:.1f} s after {after} (the limit "
                    f"is {timeout_s:g} s; {now - t0:.1f} s since the request was sent, "
                    f"{count} responses)") from None


def generate(url: str, model: str, *, text: str | None = None, input_ids=None,
             sampling: dict | None = None, stream: bool = True, timeout_s: float = 120.0,
             cancel_after: int | None = None, on_text=None, cancel=None) -> GenerateResult:
    """One request to a generate model over a gRPC stream (it is decoupled): the responses'
    text and ids gathered until the one flagged final. cancel_after: close the stream with its
    request cancelled after that many responses (the server must end the sequence at once);
    cancel: a threading.Event that does the same when it is set (looked at every
    CANCEL_POLL_S, whether responses come or not: a generation that is not streamed sends
    none until its end). on_text(piece) is called with each response's new text as it
    arrives. A refusal's gRPC status name is in the result's `status`."""
    import queue

    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    if text is not None:
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(t)
    if input_ids is not None:
        ids = np.asarray(input_ids, np.int32).reshape(-1)
        t = grpcclient.InferInput("input_ids", list(ids.shape), "INT32")
        t.set_data_from_numpy(ids)
        inputs.append(t)
    t = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    t.set_data_from_numpy(np.array([json.dumps(sampling or {}).encode()], dtype=np.object_))
    inputs.append(t)
    t = grpcclient.InferInput("stream", [1], "BOOL")
    t.set_data_from_numpy(np.array([stream]))
    inputs.append(t)
    pieces, ids, final, count = [], [], {}, 0
    first_ms, error, status, logprobs, prompt_logprobs = None, None, None, None, None
    t0 = time.perf_counter()

    def cancelled() -> bool:
        return (cancel_after is not None and count >= cancel_after) or (
            cancel is not None and cancel.is_set())

    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            try:
                got = next_response(responses, cancelled, timeout_s, model, t0, count)
            except TimeoutError:
                # Its request cancelled: closing the stream alone waits for the generation
                # to end, and the generation goes on (a prompt being scored sends nothing)
                client.stop_stream(cancel_requests=True)
                raise
            if got is None:
                client.stop_stream(cancel_requests=True)
                final = {"finish_reason": "cancelled"}
                break
            result, err = got
            count += 1
            if err is not None:
                error = err.message() if hasattr(err, "message") else str(err)
                status = _status_name(err, error)
                break
            piece = result.as_numpy("text_output")
            new_ids = result.as_numpy("token_ids")
            new_ids = [] if new_ids is None else [int(x) for x in new_ids.reshape(-1)]
            new_logprobs = result.as_numpy("logprobs")
            if new_logprobs is not None:
                new_logprobs = json.loads(new_logprobs[0])
                logprobs = (logprobs or []) + new_logprobs
            new_prompt_logprobs = result.as_numpy("prompt_logprobs")
            if new_prompt_logprobs is not None:
                new_prompt_logprobs = prompt_logprobs = json.loads(new_prompt_logprobs[0])
            if piece is not None and len(piece):
                pieces.append(piece[0].decode())
                if on_text is not None and (pieces[-1] or new_logprobs or new_prompt_logprobs):
                    got = Piece(pieces[-1])
                    got.token_ids, got.logprobs = new_ids, new_logprobs
                    got.prompt_logprobs = new_prompt_logprobs
                    on_text(got)
            ids += new_ids
            if first_ms is None and (pieces and pieces[-1] or ids):
                first_ms = (time.perf_counter() - t0) * 1e3
            reason = result.as_numpy("finish_reason")
            if reason is not None:
                final = {"finish_reason": reason[0].decode(),
                         "prompt_tokens": int(result.as_numpy("prompt_tokens")[0]),
                         "completion_tokens": int(result.as_numpy("completion_tokens")[0])}
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                break
            if cancelled():
                client.stop_stream(cancel_requests=True)
                final = {"finish_reason": "cancelled"}
                break
    finally:
        client.stop_stream()
        client.close()
    return GenerateResult("".join(pieces), ids, final.get("finish_reason", "error"),
                          final.get("prompt_tokens", 0), final.get("completion_tokens", 0),
                          count, first_ms, error, status, logprobs, prompt_logprobs)


def generate_http(url: str, model: str, *, text: str | None = None, input_ids=None,
                  sampling: dict | None = None, stream: bool = True,
                  timeout_s: float = 120.0) -> GenerateResult:
    """One request to a generate model over HTTP: Triton's generate extension
    (POST /v2/models/MODEL/generate_stream, one server-sent event a response), as curl or any
    HTTP client would send it. The inputs are JSON fields of the request's body."""
    import urllib.error
    import urllib.request

    body = {"sampling_parameters": json.dumps(sampling or {}), "stream": stream}
    if text is not None:
        body["text_input"] = text
    if input_ids is not None:
        body["input_ids"] = [int(t) for t in np.asarray(input_ids).reshape(-1)]
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    pieces, ids, final, count, first_ms, error = [], [], {}, 0, None, None
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            for line in r:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                count += 1
                if "error" in event:
                    error = event["error"]
                    break
                pieces.append(event.get("text_output", ""))
                new_ids = event.get("token_ids", [])
                ids += [int(t) for t in (new_ids if isinstance(new_ids, list) else [new_ids])]
                if first_ms is None and (pieces[-1] or ids):
                    first_ms = (time.perf_counter() - t0) * 1e3
                if "finish_reason" in event:
                    final = {k: event[k] for k in ("finish_reason", "prompt_tokens",
                                                   "completion_tokens")}
    except urllib.error.HTTPError as e:  # refused before any event
        count += 1
        error = json.loads(e.read() or b"{}").get("error", str(e))
    return GenerateResult("".join(pieces), ids, final.get("finish_reason", "error"),
                          int(final.get("prompt_tokens", 0)),
                          int(final.get("completion_tokens", 0)), count, first_ms, error,
                          _status_name(None, error) if error else None)


# The backend applies its metric updates every 250 ms (metrics_interval_microseconds, on a
# thread of their own): a scrape that must see the requests just answered waits this long.
METRICS_SETTLE_S = 0.6


def scrape_metrics(url: str, prefix: str = "tlaloc_", settle_s: float = 0.0,
                   ) -> dict[tuple[str, tuple], float]:
    """Triton's Prometheus text at `url`, as {(name, sorted label pairs): value} for the metrics
    whose name starts with `prefix`; after waiting `settle_s` (METRICS_SETTLE_S to see every
    request answered so far)."""
    import re
    import urllib.request

    if settle_s:
        time.sleep(settle_s)

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    line_re = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)')
    label_re = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = line_re.match(line)
        if m:
            labels = tuple(sorted(label_re.findall(m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(values: dict, name: str, **labels) -> float:
    """The sum of a scraped metric over the series whose labels include `labels`."""
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


REUSE_COUNTERS = {"queries": "tlaloc_prefix_cache_queries_total",
                  "hits": "tlaloc_prefix_cache_hits_total",
                  "continued": "tlaloc_turn_continuations_total"}


def reuse_counters(values: dict, model: str) -> dict[str, float]:
    """A model's KV reuse counters in scraped metrics: prompt tokens looked up (queries) and
    found cached (hits), and turns that continued an ended sequence (continued)."""
    return {k: metric(values, name, model=model) for k, name in REUSE_COUNTERS.items()}


def full_pool_pages(values: dict, model: str) -> dict[str, float]:
    """A model's full-history pages in scraped metrics: held by live sequences (used), cached
    and free; they add up to the pool."""
    return {what: metric(values, f"tlaloc_kv_pages_{what}", model=model, pool="full")
            for what in ("used", "cached", "free")}

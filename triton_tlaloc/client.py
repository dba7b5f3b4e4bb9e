"""A client for a served Tlaloc model, over tritonclient's HTTP or gRPC API.

A sequence is a correlation id: the prompt goes with START, each later request carries one
token, and END (here on a request with no tokens, which runs nothing) frees the sequence's pages.
Sampling is the client's: `generate_greedy` takes the argmax of each step's logits.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np


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


def new_sequence_id() -> int:
    """A fresh random 63-bit correlation id (Triton's integer ids are uint64)."""
    return uuid.uuid4().int >> 65


class TlalocClient:
    def __init__(self, url: str, model: str, protocol: str = "grpc", timeout_s: float = 120.0):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol {protocol!r}: expected grpc or http")
        self.protocol = protocol
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

    def infer(self, seq_id, tokens, *, start: bool = False, end: bool = False,
              want_pages: bool = False) -> tuple[np.ndarray | None, np.ndarray | None]:
        """One request; returns (logits [vocab] or None, KV_PAGES [2] or None)."""
        mod = self._mod
        arr = np.asarray(tokens, dtype=np.int32).reshape(1, -1)
        inp = mod.InferInput("TOKENS", list(arr.shape), "INT32")
        inp.set_data_from_numpy(arr)
        outputs = [mod.InferRequestedOutput("LOGITS")]
        if want_pages:
            outputs.append(mod.InferRequestedOutput("KV_PAGES"))
        kw = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        try:
            res = self._client.infer(self.model, [inp], outputs=outputs, sequence_id=seq_id,
                                     sequence_start=start, sequence_end=end, **kw)
        except self._exc as e:
            raise InferError(e.message() if hasattr(e, "message") else str(e),
                             e.status() if hasattr(e, "status") else None) from None
        logits = res.as_numpy("LOGITS")
        pages = res.as_numpy("KV_PAGES") if want_pages else None
        return (None if logits is None else logits.reshape(-1),
                None if pages is None else pages.reshape(-1))

    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                        stop_ids: tuple[int, ...] = (), seq_id=None) -> Generation:
        seq_id = seq_id if seq_id is not None else new_sequence_id()
        ended = False
        try:
            t0 = time.perf_counter()
            logits, _ = self.infer(seq_id, prompt_ids, start=True)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            ids, step_ms, reason = [], [], "length"
            while True:
                token = int(np.argmax(logits))
                ids.append(token)
                if token in stop_ids:
                    reason = "stop"
                    break
                if len(ids) >= max_new_tokens:
                    break
                t0 = time.perf_counter()
                logits, _ = self.infer(seq_id, [token])
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

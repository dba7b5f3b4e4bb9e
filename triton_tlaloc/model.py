"""The TritonPythonModel: thin glue between Triton's Python backend and the batcher.

initialize() validates the manifest, compiles every entry (with the compile cache), uploads the
weights once, allocates the pools and starts the batcher thread. execute() turns each request
into a `batcher.Request` holding its response sender and returns None at once: the batcher
thread answers every request exactly once, from its own thread (FACTS.md: a non-decoupled model
may answer through its response senders later; plain HTTP and gRPC unary infer then work).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from .batcher import (INTERNAL, INVALID_ARG, UNAVAILABLE, Batcher, BatchPolicy, Observer, Reply,
                      Request, TimingLog)
from .engine import Engine
from .manifest import load_artifact
from .metrics import MetricsWriter
from .outputs import TOP_K_DEFAULT, small_outputs, top_k_parameter
from .runtime import Runtime

# Model config parameters and their defaults (README.md, "Model parameters").
DEFAULTS = {
    "serving_manifest": "artifact/tlaloc-serving.json",
    "donate_kv_pools": "true",
    "cohort_wait_microseconds": "20000",
    "prefill_wait_microseconds": "2000",
    "backend_batching": "true",
    "reclaim_allowance_microseconds": "2000000",
    "compile_cache_dir": "",
    "platform": "",
    "tokenizer_dir": "",
    "timing_log": "",
    "metrics_interval_microseconds": "250000",
}


class _TritonLogHandler(logging.Handler):
    """Our loggers into Triton's log (so INFO lines appear in the server log)."""

    def emit(self, record):
        msg = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(msg)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(msg)
        else:
            pb_utils.Logger.log_info(msg)


def _setup_logging(model_name: str) -> None:
    # Each model instance runs in its own stub process: the prefix names the model.
    logger = logging.getLogger("triton_tlaloc")
    if not any(isinstance(h, _TritonLogHandler) for h in logger.handlers):
        handler = _TritonLogHandler()
        handler.setFormatter(logging.Formatter(f"[tlaloc {model_name}] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _bool(text: str) -> bool:
    v = text.strip().lower()
    if v not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}")
    return v in ("true", "1", "yes")


def model_settings(args, defaults: dict) -> tuple[dict, dict, Path, str, int]:
    """(the config, its parameters over `defaults`, the version directory, the PJRT platform,
    the device index): the platform from the parameter `platform` or the instance group's
    kind, the device the instance group names (one PJRT client per device)."""
    config = json.loads(args["model_config"])
    params = dict(defaults)
    for key, value in config.get("parameters", {}).items():
        params[key] = value["string_value"]
    version_dir = Path(args["model_repository"]) / str(args["model_version"])
    kind = args.get("model_instance_kind", "CPU")
    platform = params["platform"] or ("cuda" if kind == "GPU" else "cpu")
    device = int(args.get("model_instance_device_id", 0)) if platform != "cpu" else 0
    return config, params, version_dir, platform, device


class TritonPythonModel:
    def initialize(self, args):
        _setup_logging(args["model_name"])
        log = logging.getLogger("triton_tlaloc.model")
        t0 = time.perf_counter()
        config, params, version_dir, platform, device = model_settings(args, DEFAULTS)
        manifest = Path(params["serving_manifest"])
        if not manifest.is_absolute():
            manifest = version_dir / manifest
        artifact = load_artifact(manifest.parent)  # refuses a bad artifact by name
        cache = params["compile_cache_dir"] or None
        self.runtime = Runtime(artifact, platform=platform, device_index=device,
                               donate=_bool(params["donate_kv_pools"]),
                               cache_dir=Path(cache) if cache else None)
        idle_us = int(config.get("sequence_batching", {}).get("max_sequence_idle_microseconds")
                      or 1_000_000)  # Triton's default when unset
        policy = BatchPolicy(
            cohort_wait_s=int(params["cohort_wait_microseconds"]) / 1e6,
            prefill_wait_s=int(params["prefill_wait_microseconds"]) / 1e6,
            backend_batching=_bool(params["backend_batching"]),
            idle_timeout_s=idle_us / 1e6,
            reclaim_allowance_s=int(params["reclaim_allowance_microseconds"]) / 1e6)
        self.metrics = TritonMetrics(args["model_name"],
                                     int(params["metrics_interval_microseconds"]) / 1e6)
        observers = [self.metrics]
        self.timing_log = TimingLog(params["timing_log"]) if params["timing_log"] else None
        if self.timing_log is not None:
            observers.append(self.timing_log)
            log.info("timing log: one line per call in %s", params["timing_log"])
        self.batcher = Batcher(Engine(self.runtime), policy, observers=tuple(observers))
        self.metrics.state(self.batcher.pool_state(), 0)
        self.metrics.memory(self.runtime.weight_bytes, self.runtime.kv_pool_bytes,
                            self.runtime.state_pool_bytes)
        self.batcher.start()
        rt, m = self.runtime, artifact.model
        weights = m.weight_dtype + (f", {m.quantized}" if m.quantized else "")
        slots = artifact.linear_state.num_slots if artifact.linear_state else 0
        log.info("model %s loaded in %.1f s: %s, %d entries (%d compiled, %d from the cache), "
                 "weights %.1f MiB (%s), KV pools %.1f MiB (%d pages of %d tokens, %s), state "
                 "pools %.1f MiB (%d slots), platform %s, donate_kv_pools %s; %s",
                 args["model_name"], time.perf_counter() - t0, m.model_name, len(rt.executables),
                 rt.compile_stats.compiled, rt.compile_stats.cache_hits, rt.weight_bytes / 2**20,
                 weights, rt.kv_pool_bytes / 2**20, m.num_blocks, m.block_size, m.kv_dtype,
                 rt.state_pool_bytes / 2**20, slots, platform, params["donate_kv_pools"], policy)

    def execute(self, requests):
        batch = []
        for r in requests:
            sender = r.get_response_sender()
            wanted = set(r.requested_output_names())
            reply_fn = _Reply(sender, wanted, self.metrics)
            try:
                reply_fn.top_k = top_k_parameter(r.parameters(), self.runtime.artifact.model.vocab)
                tokens = pb_utils.get_input_tensor_by_name(r, "TOKENS").as_numpy().reshape(-1)
                start = pb_utils.get_input_tensor_by_name(r, "START")
                end = pb_utils.get_input_tensor_by_name(r, "END")
                request = Request(
                    seq_id=r.correlation_id(),
                    tokens=[int(t) for t in tokens],
                    start=bool(start is not None and start.as_numpy().reshape(-1)[0]),
                    end=bool(end is not None and end.as_numpy().reshape(-1)[0]),
                    reply_fn=reply_fn)
            except Exception as e:  # a malformed request: answered here, once
                reply_fn(Reply(error=f"malformed request: {e}", code=INVALID_ARG))
                continue
            batch.append(request)
        self.batcher.submit_group(batch)
        return None

    def finalize(self):
        stats = self.batcher.stats
        d = self.runtime.donation
        logging.getLogger("triton_tlaloc.model").info(
            "unloading: %s calls, %s rows, refusals %s; pools in place %d/%d checked runs",
            stats.calls, stats.rows, stats.refusals or "none", d.in_place, d.checked_runs)
        self.batcher.stop()
        self.metrics.writer.close()
        if self.timing_log is not None:
            self.timing_log.close()


class TritonMetrics(Observer):
    """The batcher's observer: Prometheus metrics on Triton's metrics port (README.md names
    them). Every metric carries the model's name as a label."""

    WAIT_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]
    EXEC_BUCKETS = [1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
    SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64]

    def __init__(self, model_name: str, interval_s: float = 0.25):
        F = pb_utils.MetricFamily
        self.labels = {"model": model_name}
        # Updates are applied on the writer's thread (metrics.py): each is an IPC round trip.
        self.writer = MetricsWriter(interval_s)
        self.has_histograms = hasattr(F, "HISTOGRAM")

        # A MetricFamily must outlive its Metrics: every family is kept here.
        self.families = []

        def family(name, description, kind):
            self.families.append(F(name=name, description=description, kind=kind))
            return self.families[-1]

        pages_used = family("tlaloc_kv_pages_used", "KV pages held by sequences", F.GAUGE)
        pages_free = family("tlaloc_kv_pages_free", "KV pages free", F.GAUGE)
        self.pages_used = {pool: pages_used.Metric(labels={**self.labels, "pool": pool})
                           for pool in ("full", "windowed")}
        self.pages_free = {pool: pages_free.Metric(labels={**self.labels, "pool": pool})
                           for pool in ("full", "windowed")}
        # A hybrid model's linear-attention state slots (schema v4), one per live sequence.
        self.pages_used["state"] = family(
            "tlaloc_state_slots_used", "Linear-attention state slots held by sequences",
            F.GAUGE).Metric(labels=self.labels)
        self.pages_free["state"] = family(
            "tlaloc_state_slots_free", "Linear-attention state slots free",
            F.GAUGE).Metric(labels=self.labels)
        self.sequences = family("tlaloc_sequences_held", "Sequences holding state in the "
                                "backend", F.GAUGE).Metric(labels=self.labels)
        self._memory = family("tlaloc_device_bytes", "Bytes the model holds on its device, by "
                              "what (weights, kv_pools, state_pools)", F.GAUGE)
        self._executions = family("tlaloc_executions_total", "Entry executions by kind",
                                  F.COUNTER)
        self._tokens = family("tlaloc_tokens_total", "Tokens run, prefill and decode", F.COUNTER)
        self._refusals = family("tlaloc_refusals_total", "Requests refused, by reason",
                                F.COUNTER)
        self.reclaimed_pages = family("tlaloc_pages_reclaimed_total", "KV pages reclaimed from "
                                      "sequences Triton ended", F.COUNTER).Metric(labels=self.labels)
        self.reclaimed_sequences = family(
            "tlaloc_sequences_reclaimed_total", "Sequences reclaimed after Triton ended them",
            F.COUNTER).Metric(labels=self.labels)
        self._phases = family("tlaloc_call_phase_seconds_total", "Seconds spent in each phase "
                              "of the calls (batcher.CallTiming), by kind of call", F.COUNTER)
        self._by_label: dict = {}
        if self.has_histograms:
            self._batch = family("tlaloc_batch_size", "Rows per execution", F.HISTOGRAM)
            self._exec = family("tlaloc_execution_seconds", "Execution time of a call",
                                F.HISTOGRAM)
            self.wait = family("tlaloc_backend_wait_seconds", "Time a request waits in the "
                               "backend before its execution starts", F.HISTOGRAM).Metric(
                labels=self.labels, buckets=self.WAIT_BUCKETS)
            self.send = family("tlaloc_response_send_seconds", "Time a response takes to hand "
                               "over to Triton (the python backend's IPC)", F.HISTOGRAM).Metric(
                labels=self.labels, buckets=self.WAIT_BUCKETS)

    def memory(self, weights: int, kv_pools: int, state_pools: int) -> None:
        for what, n in (("weights", weights), ("kv_pools", kv_pools),
                        ("state_pools", state_pools)):
            self.writer.set(self._metric(self._memory, what=what), n)

    def sent(self, seconds: float) -> None:
        if self.has_histograms:
            self.writer.observe(self.send, seconds)

    def _metric(self, family, buckets=None, **labels):
        """The family's metric for these labels (with the model's), made on first use."""
        k = (id(family), tuple(sorted(labels.items())))
        if k not in self._by_label:
            kw = {"buckets": buckets} if buckets is not None else {}
            self._by_label[k] = family.Metric(labels={**self.labels, **labels}, **kw)
        return self._by_label[k]

    def call(self, kind, entry, rows, tokens, waits_s, seconds, executions=1):
        w = self.writer
        w.increment(self._metric(self._executions, kind=kind), executions)
        w.increment(self._metric(self._tokens, kind=kind), tokens)
        if self.has_histograms:
            w.observe(self._metric(self._batch, self.SIZE_BUCKETS, kind=kind), rows)
            w.observe(self._metric(self._exec, self.EXEC_BUCKETS, kind=kind), seconds)
            for wait in waits_s:
                w.observe(self.wait, wait)

    def refusal(self, reason):
        self.writer.increment(self._metric(self._refusals, reason=reason), 1)

    def timing(self, t):
        for phase in t.PHASES:
            self.writer.increment(self._metric(self._phases, kind=t.kind, phase=phase),
                                  getattr(t, phase))

    def reclaimed(self, sequences, pages):
        self.writer.increment(self.reclaimed_sequences, sequences)
        self.writer.increment(self.reclaimed_pages, pages)

    def state(self, pools, sequences):
        for pool, (used, free) in pools.items():
            self.writer.set(self.pages_used[pool], used)
            self.writer.set(self.pages_free[pool], free)
        self.writer.set(self.sequences, sequences)


def _error_code(code: str):
    # pb_utils.TritonError is bound only once the stub runs the model, not at import time.
    return {INVALID_ARG: pb_utils.TritonError.INVALID_ARG,
            UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
            INTERNAL: pb_utils.TritonError.INTERNAL}[code]


class _Reply:
    """The function that answers one request: builds its response and sends it. Called exactly
    once per request (batcher.Request.reply), always from one thread at a time: a send waits
    for Triton's process to take the response (~1 ms, whatever its size), and sends from
    several threads at once crashed tritonserver (boost::interprocess::lock_exception in
    libtriton_python.so, docs/performance.md). Only the outputs the request names are sent
    (Triton names them all when a client names none)."""

    def __init__(self, sender, wanted: set, metrics: TritonMetrics | None):
        self.sender, self.wanted, self.metrics = sender, wanted, metrics
        self.top_k = TOP_K_DEFAULT

    def response(self, reply: Reply):
        if reply.error is not None:
            return pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(reply.error,
                                                              _error_code(reply.code)))
        outputs = []
        if reply.logits is not None:
            if "LOGITS" in self.wanted:
                outputs.append(pb_utils.Tensor("LOGITS", np.ascontiguousarray(
                    reply.logits.reshape(1, -1), dtype=np.float32)))
            outputs += [pb_utils.Tensor(name, value) for name, value in
                        small_outputs(reply.logits, self.wanted, self.top_k).items()]
        if "KV_PAGES" in self.wanted and reply.kv_pages is not None:
            outputs.append(pb_utils.Tensor("KV_PAGES", np.array([reply.kv_pages], np.int32)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def __call__(self, reply: Reply) -> None:
        t0 = time.perf_counter()
        try:
            self.sender.send(self.response(reply),
                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # a client gone away must not take the batcher thread down
            logging.getLogger("triton_tlaloc.model").exception("sending a response failed")
            return
        if self.metrics is not None:
            self.metrics.sent(time.perf_counter() - t0)

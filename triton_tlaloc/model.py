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
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from .batcher import INTERNAL, INVALID_ARG, UNAVAILABLE, Batcher, Reply, Request
from .engine import Engine
from .manifest import load_artifact
from .runtime import Runtime

# Model config parameters and their defaults (README.md, "Model parameters").
DEFAULTS = {
    "serving_manifest": "artifact/tlaloc-serving.json",
    "donate_kv_pools": "true",
    "cohort_wait_microseconds": "20000",
    "prefill_wait_microseconds": "2000",
    "compile_cache_dir": "",
    "platform": "",
    "tokenizer_dir": "",
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


class TritonPythonModel:
    def initialize(self, args):
        _setup_logging(args["model_name"])
        log = logging.getLogger("triton_tlaloc.model")
        t0 = time.perf_counter()
        config = json.loads(args["model_config"])
        params = dict(DEFAULTS)
        for key, value in config.get("parameters", {}).items():
            params[key] = value["string_value"]
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        manifest = Path(params["serving_manifest"])
        if not manifest.is_absolute():
            manifest = version_dir / manifest
        kind = args.get("model_instance_kind", "CPU")
        platform = params["platform"] or ("cuda" if kind == "GPU" else "cpu")
        device = int(args.get("model_instance_device_id", 0)) if platform != "cpu" else 0
        artifact = load_artifact(manifest.parent)  # refuses a bad artifact by name
        cache = params["compile_cache_dir"] or None
        self.runtime = Runtime(artifact, platform=platform, device_index=device,
                               donate=_bool(params["donate_kv_pools"]),
                               cache_dir=Path(cache) if cache else None)
        self.batcher = Batcher(Engine(self.runtime))
        self.batcher.start()
        rt = self.runtime
        log.info("model %s loaded in %.1f s: %s, %d entries (%d compiled, %d from the cache), "
                 "weights %.1f MiB, KV pools %.1f MiB (%d pages of %d tokens), platform %s, "
                 "donate_kv_pools %s", args["model_name"], time.perf_counter() - t0,
                 artifact.model.model_name, len(rt.executables), rt.compile_stats.compiled,
                 rt.compile_stats.cache_hits, rt.weight_bytes / 2**20, rt.pool_bytes / 2**20,
                 artifact.model.num_blocks, artifact.model.block_size, platform,
                 params["donate_kv_pools"])

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            want_pages = "KV_PAGES" in r.requested_output_names()
            reply_fn = _reply_fn(sender, want_pages)
            try:
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
            self.batcher.submit(request)
        return None

    def finalize(self):
        stats = self.batcher.stats
        d = self.runtime.donation
        logging.getLogger("triton_tlaloc.model").info(
            "unloading: %s calls, %s rows, refusals %s; pools in place %d/%d checked runs",
            stats.calls, stats.rows, stats.refusals or "none", d.in_place, d.checked_runs)
        self.batcher.stop()


def _error_code(code: str):
    # pb_utils.TritonError is bound only once the stub runs the model, not at import time.
    return {INVALID_ARG: pb_utils.TritonError.INVALID_ARG,
            UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
            INTERNAL: pb_utils.TritonError.INTERNAL}[code]


def _reply_fn(sender, want_pages: bool):
    def send(reply: Reply) -> None:
        if reply.error is not None:
            response = pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(reply.error, _error_code(reply.code)))
        else:
            outputs = []
            if reply.logits is not None:
                outputs.append(pb_utils.Tensor("LOGITS", np.ascontiguousarray(
                    reply.logits.reshape(1, -1), dtype=np.float32)))
            if want_pages and reply.kv_pages is not None:
                outputs.append(pb_utils.Tensor("KV_PAGES", np.array([reply.kv_pages], np.int32)))
            response = pb_utils.InferenceResponse(output_tensors=outputs)
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return send

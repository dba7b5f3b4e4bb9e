"""The sequence model's TritonPythonModel: thin glue between Triton's Python backend and the
batcher.

initialize() validates the manifest, compiles every entry (with the compile cache), uploads the
weights once, allocates the pools and starts the batcher thread. execute() turns each request
into a `batcher.Request` holding its response sender and returns None at once: the batcher
thread answers every request exactly once, from its own thread. A model that is not decoupled
may answer through its response senders after execute() returns, so plain HTTP and gRPC unary
infer work (docs/design.md#answering-from-a-thread).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from .triton.backend import error_response, model_settings, parse_bool, setup_logging
from .triton.parent_watch import watch_parent
from .batcher import INVALID_ARG, Batcher, Reply, Request
from .codes import coded_message
from .engine.core import Engine
from .kv.host_tier import HostTier
from .runtime.kv_transfer import PageTransfer, transfer_buckets
from .generation.link_server import LocalGenerations
from .generation.local_generation import Speculation
from .generation.grammar import Grammars
from .artifact.loading import load_artifact
from .runtime.memory import resident_bytes
from .scheduling.observer import TimingLog
from .triton.model_metrics import GrammarMetrics, TritonMetrics
from .model_parameters import DEFAULTS
from .runtime.pjrt import cpu_devices, instance_devices
from .lora.peft_adapter import AdapterError
from .triton.adapters import adapter_registry, lora_admin_parameter, lora_parameter
from .triton.server import ADMIN_KEY_ENV
from .triton.outputs import (LOGIT_OUTPUTS, TOP_K_DEFAULT, cache_salt_parameter,
                             draft_tokens_parameter, small_outputs, top_k_parameter)
from .scheduling.policy import BatchPolicy
from .triton.replies import ReplySenders
from .runtime.core import Runtime
from .runtime.simulated import SimulatedRuntime, simulated_step_s

log = logging.getLogger("triton_tlaloc.model")

# The host tier's budget by default, in device pools' worth (TensorRT-LLM sizes its host
# cache on its own; host memory is usually many times a device's KV pool).
HOST_KV_DEFAULT_POOLS = 4


def batch_policy(config: dict, params: dict[str, str]) -> BatchPolicy:
    """The batcher's policy from the model's parameters and its sequence batcher's idle
    timeout (Triton's default when unset is 1 s)."""
    idle_us = int(config.get("sequence_batching", {}).get("max_sequence_idle_microseconds")
                  or 1_000_000)
    return BatchPolicy(
        cohort_wait_s=int(params["cohort_wait_microseconds"]) / 1e6,
        cohort_wait_steps=float(params["cohort_wait_steps"]),
        prefill_wait_s=int(params["prefill_wait_microseconds"]) / 1e6,
        mixed_chunk_tokens=int(params["mixed_chunk_tokens"]),
        backend_batching=parse_bool(params["backend_batching"]),
        idle_timeout_s=idle_us / 1e6,
        reclaim_allowance_s=int(params["reclaim_allowance_microseconds"]) / 1e6)


def capi_runtime(params: dict[str, str]) -> bool:
    """Whether the `runtime` parameter asks for the C API runtime (runtime/capi.py)."""
    runtime = params["runtime"].strip()
    if runtime not in ("jax", "capi"):
        raise ValueError(f"runtime {runtime!r}: jax or capi")
    return runtime == "capi"


class TritonPythonModel:
    def initialize(self, args):
        setup_logging(args["model_name"])
        watch_parent()  # this process ends with its tritonserver
        t0 = time.perf_counter()
        config, params, version_dir, platform, device, instance = model_settings(args, DEFAULTS)
        manifest = Path(params["serving_manifest"])
        if not manifest.is_absolute():
            manifest = version_dir / manifest
        artifact = load_artifact(manifest.parent)  # refuses a bad artifact by name
        cache = params["compile_cache_dir"] or None
        step_s = simulated_step_s(params["simulate_step_ms"])  # a benchmark mode (refused
        if step_s is not None:                                  # outside one)
            log.warning("BENCHMARK MODE: simulate_step_ms %s: nothing is compiled, every call "
                        "waits %.1f ms and returns logits that are not the model's",
                        params["simulate_step_ms"], step_s * 1e3)
            self.runtime = SimulatedRuntime(artifact, step_s)
        else:
            devices = instance_devices(params["devices"], artifact.devices, instance, device,
                                       own_client=platform == "cpu")
            capi = capi_runtime(params)
            if platform == "cpu" and not capi:  # this instance's process: as many CPU
                cpu_devices(max(devices) + 1)   # devices as it uses
            self.runtime = Runtime(artifact, platform=platform, devices=devices,
                                   donate=parse_bool(params["donate_kv_pools"]),
                                   cache_dir=Path(cache) if cache else None,
                                   background=parse_bool(params["background_compile"]),
                                   first_use=False,
                                   expert_load=parse_bool(params["expert_load_metrics"]),
                                   plugin=params["pjrt_plugin"] if capi else None)
        policy = batch_policy(config, params)
        self.metrics = TritonMetrics(args["model_name"],
                                     int(params["metrics_interval_microseconds"]) / 1e6,
                                     args.get("model_instance_name", ""))
        self.adapters = adapter_registry(self.runtime, params)
        self.admin_key = os.environ.get(ADMIN_KEY_ENV) or None  # lora_admin's key
        if self.adapters is not None:
            self.metrics.watch_adapters(self.adapters)
        if getattr(self.runtime, "expert_load", None) is not None:
            self.metrics.watch_experts(self.runtime.expert_load,
                                       artifact.manifest["model"]["experts"]["layers"])
        self.senders = ReplySenders(int(params["reply_threads"]), self.metrics.reply_queued)
        observers = [self.metrics]
        self.timing_log = TimingLog(params["timing_log"]) if params["timing_log"] else None
        if self.timing_log is not None:
            observers.append(self.timing_log)
            log.info("timing log: one line per call in %s", params["timing_log"])
        engine = Engine(self.runtime, prefix_reuse=parse_bool(params["prefix_reuse"]),
                        keep_ended=int(params["keep_ended_sequences"]))
        host = self._host_tier(engine, params)
        self.batcher = Batcher(engine, policy, observers=tuple(observers), host_tier=host,
                               preempt_wait_s=int(params["preempt_wait_microseconds"]) / 1e6,
                               adapters=self.adapters)
        # Compiled entries count from here; calls held back for one run again.
        self.runtime.on_compiled = self._entry_compiled
        self._entry_compiled(len(self.runtime.executables), self.runtime.entries_total)
        self.max_context = artifact.max_context
        self.metrics.state(self.batcher.pool_state(), 0)
        self.metrics.host(0, 0)
        self.metrics.memory(*self._device_bytes())
        self.local = None
        if parse_bool(params["local_generation"]):
            speculation = Speculation.of(self.batcher.engine, self.batcher.stats,
                                         int(params["prompt_logprobs_max_tokens"]))
            grammars = Grammars(artifact.tokenizer_dir, artifact.model.vocab,
                                list(artifact.model.eos_token_ids),
                                observer=GrammarMetrics(self.metrics.writer,
                                                        self.metrics.families,
                                                        self.metrics.labels))
            self.local = LocalGenerations.open(args["model_name"], self.batcher.submit_group,
                                               artifact.max_context, speculation=speculation,
                                               instance=instance, grammars=grammars)
            if self.local is not None:
                self.batcher.round_listeners.append(self.local.round_ended)
        self.batcher.start()
        self._log_loaded(args["model_name"], time.perf_counter() - t0, platform, params, policy)

    def _entry_compiled(self, compiled: int, total: int) -> None:
        self.batcher.entries_compiled()
        self.metrics.entries(compiled, total)
        self.metrics.resident_memory(resident_bytes())

    def _device_bytes(self) -> tuple[dict, dict, dict]:
        """Weights, KV pools and state pools: bytes on each of the runtime's devices."""
        rt = self.runtime
        if isinstance(rt, SimulatedRuntime):
            return ({0: rt.weight_bytes}, {0: rt.kv_pool_bytes}, {0: rt.state_pool_bytes})
        ids = [d.id for d in rt.device.devices]
        return tuple(dict(zip(ids, per_device)) for per_device in (
            rt.weight_device_bytes, rt.kv_device_bytes, rt.state_device_bytes))

    def _host_tier(self, engine: Engine, params: dict) -> HostTier | None:
        """The host tier of `host_kv_bytes` (its transfer programs compiled now), or None."""
        rt = self.runtime
        if isinstance(rt, SimulatedRuntime):
            log.info("host tier off: a simulated runtime has no pools to copy")
            return None
        asked = params["host_kv_bytes"].strip()
        if capi_runtime(params) and rt.device.size > 1:  # split pools' copies: JAX's
            if asked and int(asked) != 0:
                raise ValueError(f"host_kv_bytes {asked}: runtime capi has no host tier on "
                                 f"several devices yet (leave host_kv_bytes unset or 0, or "
                                 f"use runtime jax)")
            log.info("host tier off: runtime capi on %d devices (a request short of KV pages "
                     "is refused)", rt.device.size)
            return None
        budget = (int(asked) if asked else
                  HOST_KV_DEFAULT_POOLS * (rt.kv_pool_bytes + rt.state_pool_bytes))
        if budget < 0:
            raise ValueError(f"host_kv_bytes {budget}: expected 0 (off) or a byte count")
        if budget == 0:
            log.info("host tier off (host_kv_bytes 0): a request short of KV pages is refused")
            return None
        transfer = PageTransfer(rt)
        host = HostTier(engine.blocks, transfer, budget)
        log.info("host tier: up to %.1f MiB of swapped-out KV%s in host memory; a request "
                 "short of pages waits up to %.1f s", budget / 2**20,
                 " and evicted prefix blocks" if engine.blocks.spill else "",
                 int(params["preempt_wait_microseconds"]) / 1e6)

        def warm():
            t0 = time.perf_counter()
            transfer.warm(transfer_buckets(rt.artifact))
            stats = transfer.compile_stats
            log.info("host tier: %d page transfer programs ready in %.2f s (%d from the "
                     "compile cache)", stats.compiled + stats.cache_hits,
                     time.perf_counter() - t0, stats.cache_hits)
        if parse_bool(params["background_compile"]):  # a swap before then compiles its own
            threading.Thread(target=warm, name="tlaloc-transfer-compile", daemon=True).start()
        else:
            warm()
        return host

    def _log_loaded(self, name, seconds, platform, params, policy) -> None:
        rt = self.runtime
        if isinstance(rt, SimulatedRuntime):
            log.info("model %s ready in %.1f s, simulated: %d entries, each call a wait of "
                     "%.1f ms; %s", name, seconds, rt.entries_total, rt.step_s * 1e3, policy)
            return
        art, m = rt.artifact, rt.artifact.model
        weights = m.weight_dtype + (f", {m.quantized}" if m.quantized else "")
        slots = art.linear_state.num_slots if art.linear_state else 0
        log.info("model %s ready in %.1f s: %s, %d of %d entries compiled so far (%d compiled, "
                 "%d from the cache), "
                 "weights %.1f MiB (%s), KV pools %.1f MiB (%d pages of %d tokens, %s), state "
                 "pools %.1f MiB (%d slots), platform %s, donate_kv_pools %s; %s",
                 name, seconds, m.model_name, len(rt.executables), rt.entries_total,
                 rt.compile_stats.compiled, rt.compile_stats.cache_hits, rt.weight_bytes / 2**20,
                 weights, rt.kv_pool_bytes / 2**20, m.num_blocks, m.block_size, m.kv_dtype,
                 rt.state_pool_bytes / 2**20, slots, platform, params["donate_kv_pools"], policy)
        blocks = self.batcher.engine.blocks
        log.info("KV reuse: prefix reuse %s, ended sequences kept for their next turn: up to %d",
                 "on" if blocks.prefix_reuse else
                 ("off" if not parse_bool(params["prefix_reuse"]) else
                  "not possible (rings or state slots: turns are continued whole)"),
                 blocks.keep_ended)

    def execute(self, requests):
        batch = []
        for r in requests:
            sender = r.get_response_sender()
            wanted = set(r.requested_output_names())
            reply_fn = _Reply(sender, wanted, self.metrics, self.senders)
            try:
                parameters = json.loads(r.parameters() or "{}")
                reply_fn.top_k = top_k_parameter(parameters, self.runtime.artifact.model.vocab)
                tokens = pb_utils.get_input_tensor_by_name(r, "TOKENS").as_numpy().reshape(-1)
                start = pb_utils.get_input_tensor_by_name(r, "START")
                end = pb_utils.get_input_tensor_by_name(r, "END")
                salt = pb_utils.get_input_tensor_by_name(r, "CACHE_SALT")
                request = Request(
                    seq_id=r.correlation_id(), tokens=[],
                    start=bool(start is not None and start.as_numpy().reshape(-1)[0]),
                    end=bool(end is not None and end.as_numpy().reshape(-1)[0]),
                    reply_fn=reply_fn,
                    cache_salt=cache_salt_parameter(parameters, _salt_bytes(salt)),
                    lora=lora_parameter(parameters),
                    admin=lora_admin_parameter(parameters, self.admin_key),
                    draft_tokens=draft_tokens_parameter(parameters),
                    want_logits=bool(wanted & LOGIT_OUTPUTS))
                # Sizes first: ids past the largest context are not converted, only refused
                # (by the batcher, so that a START still ends the sequence it replaces).
                if tokens.size > self.max_context:
                    request.refusal = ("context", f"sequence {request.seq_id}: TOKENS holds "
                                       f"{tokens.size} ids, more than the largest context "
                                       f"{self.max_context}")
                else:
                    request.tokens = tokens.tolist()
            except AdapterError as e:  # (says what it is about)
                reply_fn(Reply(error=str(e), code=INVALID_ARG))
                continue
            except Exception as e:  # a malformed request: answered here, once
                reply_fn(Reply(error=f"malformed request: {e}", code=INVALID_ARG))
                continue
            batch.append(request)
        self.batcher.submit_group(batch)
        return None

    def finalize(self):
        stats = self.batcher.stats
        log.info("unloading: %s calls, %s rows, refusals %s%s", stats.calls, stats.rows,
                 stats.refusals or "none",
                 "" if isinstance(self.runtime, SimulatedRuntime) else
                 "; pools in place {0.in_place}/{0.checked_runs} checked runs".format(
                     self.runtime.donation))
        self.runtime.close()
        self.batcher.stop()
        self.senders.stop()
        if self.local is not None:
            self.local.stop()
        self.metrics.writer.close()
        if self.timing_log is not None:
            self.timing_log.close()


def _salt_bytes(tensor) -> bytes | None:
    """The CACHE_SALT input's one element as bytes (None when the request has none)."""
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"CACHE_SALT holds {values.size} elements: expected one")
    value = values[0]
    return value.encode() if isinstance(value, str) else bytes(value)


class _Reply:
    """The function that answers one request: hands its reply to the reply senders
    (triton/replies.py), whose thread builds the response and sends it, so that the batcher thread
    does not wait for Triton's process to take it. Called exactly once per request
    (batcher.Request.reply); each response sender is used by one thread only. Only the outputs
    the request names are sent (Triton names them all when a client names none)."""

    def __init__(self, sender, wanted: set, metrics: TritonMetrics | None,
                 senders: ReplySenders):
        self.sender, self.wanted, self.metrics, self.senders = sender, wanted, metrics, senders
        self.top_k = TOP_K_DEFAULT

    def response(self, reply: Reply):
        if reply.error is not None:
            return error_response(coded_message(reply.error, reply.code), reply.code)
        outputs = []
        if reply.logits is not None:
            if "LOGITS" in self.wanted:
                outputs.append(pb_utils.Tensor("LOGITS", np.ascontiguousarray(
                    reply.logits.reshape(1, -1), dtype=np.float32)))
            outputs += [pb_utils.Tensor(name, value) for name, value in
                        small_outputs(reply.logits, self.wanted, self.top_k).items()]
        if reply.accepted_ids is not None:
            if "ACCEPTED_IDS" in self.wanted:
                outputs.append(pb_utils.Tensor("ACCEPTED_IDS",
                                               np.array([reply.accepted_ids], np.int32)))
            if reply.logits is None and "ARGMAX" in self.wanted:  # the model's own next token
                outputs.append(pb_utils.Tensor("ARGMAX",
                                               np.array([[reply.accepted_ids[-1]]], np.int32)))
        if "KV_PAGES" in self.wanted and reply.kv_pages is not None:
            outputs.append(pb_utils.Tensor("KV_PAGES", np.array([reply.kv_pages], np.int32)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def __call__(self, reply: Reply) -> None:
        self.senders.submit(lambda: self.send(reply))

    def send(self, reply: Reply) -> None:
        t0 = time.perf_counter()
        try:
            self.sender.send(self.response(reply),
                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # a client gone away must not take a sender thread down
            log.exception("sending a response failed")
            return
        if self.metrics is not None:
            self.metrics.sent(time.perf_counter() - t0)

"""The TritonPythonModel for programs that are not language models
(docs/design.md#programs-that-are-not-language-models).

- Bounded mode (parameter bounded_manifest): a tlaloc-bounded-v1 artifact; each request is
  padded to the smallest bucket that holds it, run, and its outputs sliced (BoundedRuntime).
- Generic mode (parameter program): a StableHLO program whose arguments and results are bound
  by the parameters arguments and results (program.py). A stateless program under Triton's
  dynamic batcher runs each group of requests whose rows have one shape as one execution
  (group_by_shape true; false runs only consecutive requests of one shape together, a control);
  a program with state runs each request in turn, its state donated and kept between requests.

execute() answers its requests before it returns (one response each, an error response for a
request refused by name): Triton's dynamic batcher forms the next batch meanwhile. Each
instance has its own PJRT client on the device its instance group names.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from ..triton.backend import error_response, model_settings, parse_bool, setup_logging
from ..triton.parent_watch import watch_parent
from ..triton.metrics import MetricsWriter
from .bounded import BoundedError, BoundedRuntime
from .generic import (ARGUMENT_KINDS, RESULT_KINDS, ProgramError, ProgramRuntime, parse_bindings,
                      run_batch)

DEFAULTS = {
    "bounded_manifest": "",
    "program": "",
    "arguments": "",
    "results": "",
    "group_by_shape": "true",
    "donate_state": "true",
    "compile_cache_dir": "",
    "platform": "",
    "metrics_interval_microseconds": "250000",
}

log = logging.getLogger("triton_tlaloc.programs.model")


def _read_input(tensor, triton_type: str) -> np.ndarray:
    if triton_type == "TYPE_BF16":  # numpy has no bf16: the stub hands it over by DLPack only
        import jax

        return np.asarray(jax.dlpack.from_dlpack(tensor, copy=True))
    return tensor.as_numpy()


def _output_tensor(name: str, a: np.ndarray):
    if a.dtype.name == "bfloat16":  # ml_dtypes bf16: out through DLPack, as it came in
        import jax

        return pb_utils.Tensor.from_dlpack(name, jax.device_put(np.ascontiguousarray(a),
                                                                jax.devices("cpu")[0]))
    return pb_utils.Tensor(name, np.ascontiguousarray(a))


class TritonPythonModel:
    def initialize(self, args):
        setup_logging(args["model_name"])
        watch_parent()  # this process ends with its tritonserver
        t0 = time.perf_counter()
        config, params, version_dir, platform, device, _ = model_settings(args, DEFAULTS)
        cache = Path(params["compile_cache_dir"]) if params["compile_cache_dir"] else None
        self.input_types = {i["name"]: i["data_type"] for i in config.get("input", [])}
        self.max_batch = int(config.get("max_batch_size", 0))
        self.group_by_shape = parse_bool(params["group_by_shape"])
        self.bounded = self.runtime = None
        if params["bounded_manifest"]:
            manifest = version_dir / params["bounded_manifest"]
            self.bounded = BoundedRuntime(manifest.parent, platform=platform,
                                          device_index=device, cache_dir=cache)
            what = (f"bounded program, bounds {self.bounded.art.bounds}, "
                    f"{len(self.bounded.executables)} buckets compiled")
        elif params["program"]:
            self.runtime = ProgramRuntime(
                version_dir / params["program"],
                parse_bindings(params["arguments"], ARGUMENT_KINDS, "arguments"),
                parse_bindings(params["results"], RESULT_KINDS, "results"),
                platform=platform, device_index=device, weights_root=version_dir,
                donate_state=parse_bool(params["donate_state"]), cache_dir=cache)
            if self.runtime.stateful and self.max_batch:
                raise ProgramError("a program with state runs one request at a time, in order: "
                                   "max_batch_size must be 0")
            compiled = (self.runtime.precompile_batches(self.max_batch)
                        if self.max_batch and not self.runtime.stateful else 0)
            what = (f"program {params['program']}, "
                    + ("state kept between requests" if self.runtime.stateful else
                       f"max batch {self.max_batch}, group_by_shape "
                       f"{str(self.group_by_shape).lower()}, {compiled} batch sizes compiled "
                       f"at load"))
        else:
            raise ProgramError("set the parameter bounded_manifest (a tlaloc-bounded-v1 "
                               "artifact) or program (a StableHLO program)")
        self.metrics = _ProgramMetrics(args["model_name"],
                                       int(params["metrics_interval_microseconds"]) / 1e6)
        self._counted = (0, 0, 0, 0)
        self._first_batches = 0
        log.info("model %s loaded in %.1f s on %s: %s", args["model_name"],
                 time.perf_counter() - t0, platform, what)

    def execute(self, requests):
        t0 = time.perf_counter()
        arrays, answers = [], [None] * len(requests)
        for r, request in enumerate(requests):
            try:
                arrays.append({name: _read_input(t, self.input_types.get(name, ""))
                               for name in self.input_types
                               if (t := pb_utils.get_input_tensor_by_name(request, name))
                               is not None})
            except Exception as e:  # a tensor the stub cannot hand over
                arrays.append({})
                answers[r] = ProgramError(f"malformed request: {e}")
        live = [r for r in range(len(requests)) if answers[r] is None]
        try:
            self._run(live, arrays, answers)
        except Exception as e:  # an execution failed: each unanswered request says so, once
            log.exception("program execution failed")
            for r in live:
                if answers[r] is None:
                    answers[r] = RuntimeError(f"program execution failed: "
                                              f"{type(e).__name__}: {e}")
        responses = [self._response(request, answer) for request, answer in zip(requests,
                                                                                 answers)]
        self._count(len(requests), time.perf_counter() - t0)
        return responses

    @staticmethod
    def _response(request, answer):
        """Exactly one response per request: its outputs, or its error (INVALID_ARG for a
        refusal, INTERNAL otherwise), never a traceback."""
        if not isinstance(answer, Exception):
            try:
                wanted = set(request.requested_output_names())
                return pb_utils.InferenceResponse(output_tensors=[
                    _output_tensor(name, a) for name, a in answer.items()
                    if not wanted or name in wanted])
            except Exception as e:
                log.exception("building a response failed")
                answer = RuntimeError(f"building the response failed: {type(e).__name__}: {e}")
        refused = isinstance(answer, (ProgramError, BoundedError))
        return error_response(str(answer), "INVALID_ARG" if refused else "INTERNAL")

    def _run(self, live: list[int], arrays: list[dict], answers: list) -> None:
        if self.bounded is not None:
            for r in live:
                answers[r] = self._bounded(arrays[r])
        elif self.max_batch and not self.runtime.stateful:
            for r, a in zip(live, run_batch(self.runtime, [arrays[r] for r in live],
                                            group_by_shape=self.group_by_shape,
                                            max_batch=self.max_batch)):
                answers[r] = a
        else:
            for r in live:  # in arrival order: a state sees the requests as they came
                try:
                    answers[r] = self.runtime.run(arrays[r])
                except ProgramError as e:
                    answers[r] = e

    def _bounded(self, arrays):
        try:
            outs = self.bounded.run(arrays)
        except BoundedError as e:
            return e
        return {spec.name: o for spec, o in zip(self.bounded.art.outputs, outs)}

    def _count(self, requests: int, seconds: float) -> None:
        if self.bounded is not None:
            now = (self.bounded.executions, 0, 0, 0)
        else:
            rt = self.runtime
            now = (rt.executions, rt.compiles, rt.state.in_place, rt.state.copied)
        delta = [a - b for a, b in zip(now, self._counted)]
        self._counted = now
        self.metrics.update(requests, seconds, *delta)
        if self._first_batches < 5:  # the first batches only: no per-batch logging after
            self._first_batches += 1
            log.info("batch of %d requests: %d executions", requests, delta[0])

    def finalize(self):
        if self.runtime is not None:
            rt = self.runtime
            log.info("unloading: %d executions, %d compiled shapes; state in place %d, copied "
                     "%d", rt.executions, rt.compiles, rt.state.in_place, rt.state.copied)
        self.metrics.writer.close()


class _ProgramMetrics:
    def __init__(self, model_name: str, interval_s: float):
        F = pb_utils.MetricFamily
        labels = {"model": model_name}
        self.writer = MetricsWriter(interval_s)
        self.families = [
            F(name="tlaloc_program_requests_total", description="Requests a program model "
              "answered", kind=F.COUNTER),
            F(name="tlaloc_program_executions_total", description="Program executions (one "
              "per group of requests run together)", kind=F.COUNTER),
            F(name="tlaloc_program_compiles_total", description="Program executables "
              "compiled or loaded from the cache, one per set of input shapes", kind=F.COUNTER),
            F(name="tlaloc_program_state_runs_total", description="Executions of a program "
              "with state, by whether the state stayed at its address (in_place) or moved "
              "(copied)", kind=F.COUNTER),
            F(name="tlaloc_program_busy_seconds_total", description="Time spent in execute() "
              "(reading the requests, running, building the responses)", kind=F.COUNTER)]
        self.requests, self.executions, self.compiles = (f.Metric(labels=labels)
                                                         for f in self.families[:3])
        self.busy = self.families[4].Metric(labels=labels)
        self.in_place = self.families[3].Metric(labels={**labels, "state": "in_place"})
        self.copied = self.families[3].Metric(labels={**labels, "state": "copied"})

    def update(self, requests, seconds, executions, compiles, in_place, copied) -> None:
        for metric, value in ((self.requests, requests), (self.busy, seconds),
                              (self.executions, executions),
                              (self.compiles, compiles), (self.in_place, in_place),
                              (self.copied, copied)):
            if value:
                self.writer.increment(metric, value)

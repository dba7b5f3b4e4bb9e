"""Metric updates applied off the batcher's thread.

A Python-backend metric update (`pb_utils.Metric.increment`, `.set`, `.observe`) is a round trip
to Triton's process, about 0.1 ms, and a decode step made ~20 of them (counters, gauges,
histograms, the phase counters): measured by scripts/step_profile.py, they delayed each reply
and the pickup of the next request. `MetricsWriter` takes updates on the batcher thread as
plain Python (counters summed, gauges' last value kept, histogram observations queued) and
applies them on its own thread every `interval_s` (vllm_backend also updates its metrics from a
thread of their own). Metrics on the metrics port lag by at most about one interval.

Pure Python: a metric is anything with increment / set / observe, so it is tested with fakes.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("triton_tlaloc.metrics")


class MetricsWriter:
    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._counters: dict[int, list] = {}  # id(metric) -> [metric, sum]
        self._gauges: dict[int, list] = {}  # id(metric) -> [metric, value]
        self._observations: list[tuple[object, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tlaloc-metrics", daemon=True)
        self._thread.start()

    def increment(self, metric, value: float) -> None:
        with self._lock:
            slot = self._counters.setdefault(id(metric), [metric, 0.0])
            slot[1] += value

    def set(self, metric, value: float) -> None:
        with self._lock:
            self._gauges[id(metric)] = [metric, value]

    def observe(self, metric, value: float) -> None:
        with self._lock:
            self._observations.append((metric, value))

    def flush(self) -> None:
        """Apply every update taken so far (on the calling thread)."""
        with self._lock:
            counters, self._counters = self._counters, {}
            gauges, self._gauges = self._gauges, {}
            observations, self._observations = self._observations, []
        try:
            for metric, value in counters.values():
                metric.increment(value)
            for metric, value in gauges.values():
                metric.set(value)
            for metric, value in observations:
                metric.observe(value)
        except Exception:  # metrics must never take serving down
            log.exception("applying metric updates failed")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self) -> None:
        """Stop the thread after a last flush."""
        self._stop.set()
        self._thread.join()
        self.flush()

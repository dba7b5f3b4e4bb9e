"""Metric updates applied off the batcher's thread.

A Python-backend metric update (`pb_utils.Metric.increment`, `.set`, `.observe`) is a round trip
to Triton's process, about 0.1 ms, and a decode step made ~20 of them (counters, gauges,
histograms, the phase counters): measured by scripts/step_profile.py, they delayed each reply
and the pickup of the next request. `MetricsWriter` takes updates on the batcher thread as
plain Python (counters summed, gauges' last value kept, histogram observations queued) and
applies them on its own thread every `interval_s` (vllm_backend also updates its metrics from a
thread of their own). Metrics on the metrics port lag by at most about one interval.

Each update is applied on its own: one that fails (Triton refuses a counter's negative increment,
for one) is logged, the first time for its metric, and the rest of the flush is applied all the
same, gauges included. A negative increment is refused when it is taken (a counter never goes
down; summed with others it would hide in their sum), logged with its metric the first time.

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
        self.failed = 0  # updates that raised when applied, so far
        self.refused = 0  # negative increments refused, so far
        self._logged: set[tuple[str, int]] = set()  # (update, id(metric)) logged once
        self.names: dict[int, str] = {}  # id(metric) -> its name and labels, for log lines
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tlaloc-metrics", daemon=True)
        self._thread.start()

    def increment(self, metric, value: float) -> None:
        if not value >= 0:  # negative, or NaN: Triton refuses it, and a sum would hide it
            with self._lock:
                self.refused += 1
                first = self._first("refused", metric)
            if first:
                log.error("metric %s: increment %r refused (a counter only goes up); "
                          "such increments are dropped", self.name_of(metric), value)
            return
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
        """Apply every update taken so far (on the calling thread), each on its own: one that
        fails is logged and the others are applied."""
        with self._lock:
            counters, self._counters = self._counters, {}
            gauges, self._gauges = self._gauges, {}
            observations, self._observations = self._observations, []
        for how, updates in (("increment", counters.values()), ("set", gauges.values()),
                             ("observe", observations)):
            for metric, value in updates:
                try:
                    getattr(metric, how)(value)
                except Exception:  # metrics must never take serving down
                    with self._lock:
                        self.failed += 1
                        first = self._first(how, metric)
                    if first:
                        log.exception("applying metric updates failed: %s %s(%r) (logged "
                                      "once for this metric; the other updates are applied)",
                                      self.name_of(metric), how, value)

    def name(self, metric, text: str):
        """Name `metric` in log lines (its family's name and labels); returns it."""
        self.names[id(metric)] = text
        return metric

    def name_of(self, metric) -> str:
        return self.names.get(id(metric)) or repr(metric)

    def _first(self, what: str, metric) -> bool:
        """Whether `what` happens to `metric` for the first time (under the lock)."""
        key = (what, id(metric))
        if key in self._logged:
            return False
        self._logged.add(key)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self) -> None:
        """Stop the thread after a last flush."""
        self._stop.set()
        self._thread.join()
        self.flush()

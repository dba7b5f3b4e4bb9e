"""Metric updates that Triton refuses: triton/metrics.MetricsWriter applies each update of a flush
on its own (one that fails loses only itself, never the gauges after it) and refuses a negative
increment when it is taken; triton/model_metrics.TritonMetrics over a fake
triton_python_backend_utils whose counters refuse a negative increment as Triton's do. Each check
runs against the writer as it was (one try around a whole flush, every increment summed), which
fails it. And what the pools' gauges count: at every report, tlaloc_sequences_held and
tlaloc_kv_pages_used count the same live sequences through a real batcher over checks/fakes.py
(control: a usage that counts kept pages as used)."""

from __future__ import annotations

import importlib
import logging
import math
import sys
import types

import pytest
from checks.fakes import Harness, fake_artifact

from triton_tlaloc.kv.cache_kinds import FullPages
from triton_tlaloc.kv.page_pools import FULL
from triton_tlaloc.scheduling.observer import CallTiming, Observer
from triton_tlaloc.triton import metrics as metrics_module
from triton_tlaloc.triton.metrics import MetricsWriter

REFUSED = ("TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by "
           "non-negative values.")  # libtritonserver's words


class OldWriter(MetricsWriter):
    """The known-wrong variant: every increment summed, whatever its sign, and a flush's updates
    applied in one try (the first that fails drops the rest of the flush)."""

    def increment(self, metric, value):
        with self._lock:
            slot = self._counters.setdefault(id(metric), [metric, 0.0])
            slot[1] += value

    def flush(self):
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
        except Exception:
            metrics_module.log.exception("applying metric updates failed")


class FakeMetric:
    """A pb_utils.Metric: a counter refuses a negative increment (and a set), as Triton does."""

    def __init__(self, kind: str, labels: dict):
        self.kind, self.labels = kind, labels
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, value):
        if self.kind == "counter" and not value >= 0:
            raise RuntimeError(f"Failed to increment metric value: {REFUSED}")
        self.value += value

    def set(self, value):
        if self.kind == "counter":
            raise RuntimeError("a counter cannot be set")
        self.value = value

    def observe(self, value):
        self.observed.append(value)


def fake_pb_utils() -> types.ModuleType:
    """A triton_python_backend_utils with MetricFamily (counters, gauges, histograms); every
    metric made is kept in `made` by (family name, sorted labels)."""
    mod = types.ModuleType("triton_python_backend_utils")
    made: dict = {}

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels, buckets=None):
            m = FakeMetric(self.kind, dict(labels))
            made[(self.name, tuple(sorted(labels.items())))] = m
            return m

    mod.MetricFamily = MetricFamily
    mod.made = made
    return mod


def quiet_writer(cls):
    """A writer whose own thread never flushes during a test (the test flushes)."""
    return cls(interval_s=3600.0)


def refuse(value):
    raise RuntimeError("Triton refused this update")


def flush_one_refused(cls) -> tuple[dict, MetricsWriter]:
    """A flush whose first update Triton refuses, then a gauge, a counter and an observation:
    what each metric got."""
    refusing, counter, gauge, hist = (FakeMetric("gauge", {}), FakeMetric("counter", {}),
                                      FakeMetric("gauge", {}), FakeMetric("histogram", {}))
    refusing.increment = refuse
    w = quiet_writer(cls)
    w.name(refusing, "tlaloc_refusing")
    w.increment(refusing, 1)  # applied first: counters come before gauges
    w.increment(counter, 2)
    w.set(gauge, 7)
    w.observe(hist, 0.5)
    w.flush()
    got = {"counter": counter.value, "gauge": gauge.value, "observed": hist.observed}
    w.close()
    return got, w


def test_a_refused_update_loses_only_itself(caplog):
    """One update that fails leaves the others of its flush applied, gauges included; it is
    logged once for its metric, by name, and counted. Control: the writer as it was lost the
    whole flush."""
    caplog.set_level(logging.ERROR, logger="triton_tlaloc.metrics")
    got, w = flush_one_refused(MetricsWriter)
    assert got == {"counter": 2, "gauge": 7, "observed": [0.5]}
    assert w.failed == 1
    logged = [r for r in caplog.records if "applying metric updates failed" in r.getMessage()]
    assert len(logged) == 1 and "tlaloc_refusing" in logged[0].getMessage()

    # The same failure again: applied around it again, not logged again.
    refusing, gauge = FakeMetric("counter", {}), FakeMetric("gauge", {})
    refusing.increment = refuse
    w = quiet_writer(MetricsWriter)
    caplog.clear()
    for v in (3, 4):
        w.increment(refusing, 1)
        w.set(gauge, v)
        w.flush()
        assert gauge.value == v
    w.close()
    assert w.failed == 2
    assert len([r for r in caplog.records if "applying metric" in r.getMessage()]) == 1

    # Control: the old writer's flush stops at the refused update.
    got, _ = flush_one_refused(OldWriter)
    assert got == {"counter": 0.0, "gauge": 0.0, "observed": []}


def test_a_negative_increment_is_refused_when_taken(caplog):
    """A counter only goes up: a negative (or NaN) increment is dropped on the caller's thread,
    logged once naming its metric; the counter's other increments are applied. Control: summed
    with them, it made the sum smaller (or NaN) without a word."""
    caplog.set_level(logging.ERROR, logger="triton_tlaloc.metrics")

    def run(cls) -> tuple[float, MetricsWriter]:
        counter = FakeMetric("gauge", {})  # accepts anything: what reaches it is the writer's
        w = quiet_writer(cls)
        w.name(counter, 'tlaloc_call_phase_seconds_total{phase="other"}')
        for v in (3, -1.0, 0.5, float("nan")):
            w.increment(counter, v)
        w.flush()
        w.close()
        return counter.value, w

    value, w = run(MetricsWriter)
    assert value == 3.5 and w.refused == 2
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1 and 'phase="other"' in logged[0] and "-1.0" in logged[0]

    old, _ = run(OldWriter)  # control
    assert math.isnan(old)


@pytest.fixture
def triton_metrics(monkeypatch):
    """triton/model_metrics.py imported over a fake triton_python_backend_utils, both taken out
    of sys.modules again after the test (the import guard refuses the real one)."""
    pb = fake_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "triton_tlaloc.triton.model_metrics", raising=False)
    module = importlib.import_module("triton_tlaloc.triton.model_metrics")
    yield module, pb
    sys.modules.pop("triton_tlaloc.triton.model_metrics", None)


def negative_other_then_state(metrics) -> None:
    """A call whose `other` phase came out negative, then the pools' gauges, in one interval."""
    metrics.timing(CallTiming("decode", "decode_b16_c1024", 16, 16, wait=0.001, admit=0.0,
                              build=0.0002, inputs=0.0003, execute=0.004, copy=0.0001,
                              respond=0.0005, other=-1e-5, total=0.006))
    metrics.state({"full": (40, 12, 204)}, 17)


def test_triton_metrics_gauges_survive_a_refused_counter(triton_metrics, caplog):
    """Through TritonMetrics, over counters that refuse a negative increment as Triton's do: a
    negative phase is refused by name and the pools' gauges and tlaloc_sequences_held are set
    in the same flush. Control: the old writer lost them all (pages used read 0 beside the
    sequences)."""
    caplog.set_level(logging.ERROR, logger="triton_tlaloc.metrics")
    module, pb = triton_metrics

    def gauges(label_model: str) -> dict:
        def value(name, **labels):
            return pb.made[(name, tuple(sorted({"model": label_model, **labels}.items())))].value
        return {"used": value("tlaloc_kv_pages_used", pool="full"),
                "cached": value("tlaloc_kv_pages_cached", pool="full"),
                "free": value("tlaloc_kv_pages_free", pool="full"),
                "held": value("tlaloc_sequences_held"),
                "execute": value("tlaloc_call_phase_seconds_total", kind="decode",
                                 phase="execute"),
                "other": value("tlaloc_call_phase_seconds_total", kind="decode", phase="other")}

    metrics = module.TritonMetrics("smol", interval_s=3600.0)
    negative_other_then_state(metrics)
    metrics.writer.flush()
    got = gauges("smol")
    assert got == {"used": 40, "cached": 12, "free": 204, "held": 17, "execute": 0.004,
                   "other": 0.0}
    assert metrics.writer.refused == 1 and metrics.writer.failed == 0
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1
    assert 'tlaloc_call_phase_seconds_total{kind="decode",model="smol",phase="other"}' \
        in logged[0]
    metrics.writer.close()

    # Control: the same updates through the writer as it was.
    old = module.TritonMetrics("old", interval_s=3600.0)
    old.writer.close()
    old.writer = quiet_writer(OldWriter)
    negative_other_then_state(old)
    old.writer.flush()
    old.writer.close()
    # (the counters before the refused one were applied; no gauge of the flush was)
    assert gauges("old") == {"used": 0.0, "cached": 0.0, "free": 0.0, "held": 0.0,
                             "execute": 0.004, "other": 0.0}


class HeldGauges(Observer):
    """At each report of the gauges (Observer.state): whether tlaloc_sequences_held and
    tlaloc_kv_pages_used{pool="full"} count the same sequences, the batcher's live ones (ended
    ones kept for a next turn in neither); what disagreed is kept, not raised (the batcher
    logs and swallows an observer's exception)."""

    def __init__(self, batcher):
        self.batcher = batcher
        self.disagreed: list[str] = []
        self.seen = {"kept beside live": 0, "live off the device": 0, "shared": 0}

    def state(self, pools, sequences):
        live = list(self.batcher.sequences.values())
        kept = list(self.batcher.engine.blocks.ended.values())
        used = pools[FULL][0]
        pages = [p for s in live for p in s.pages]
        if sequences != len(live) or used != len(set(pages)) or \
                {id(s) for s in kept} & {id(s) for s in live}:
            self.disagreed.append(f"held {sequences} ({len(live)} live, {len(kept)} kept), "
                                  f"used {used} ({len(set(pages))} pages of live ones)")
        self.seen["kept beside live"] += bool(kept and live)
        self.seen["live off the device"] += any(not s.pages for s in live)
        self.seen["shared"] += len(pages) > len(set(pages))


def n_choices_then_a_turn(h: Harness) -> None:
    """A completion's n=4 choices of one prompt (3 full blocks shared), one ending early (kept
    for its next turn) while the others decode in a pool too small for them all (swapped out
    and back in), then a next turn continuing an ended choice, all ended."""
    prompt = list(range(10, 34))
    out = h.drive({f"c{i}": (prompt, 6 if i == 0 else 30) for i in range(4)})
    turn = prompt + out["c1"][:-1]  # the whole history of c1 (its last token never fed)
    assert h.step("t", turn + [7], start=True).error is None
    assert h.step("t", [8], end=True).error is None
    assert h.batcher.stats.continuations == 1


@pytest.mark.parametrize("variant", ["as served", "kept pages counted as used"])
def test_held_sequences_and_used_pages_count_the_same_sequences(variant, monkeypatch):
    """Every report of the pools' gauges: tlaloc_sequences_held is the live sequences (swapped
    out ones too) and tlaloc_kv_pages_used the pages they hold; pages only ended sequences
    kept hold are cached, so with nothing live both read 0. Control: a usage that counts kept
    pages as used disagrees."""
    if variant != "as served":
        def wrong_usage(self, ended):
            cached = self.pool.cached
            free = self.pool.free - cached
            return self.pool.capacity - cached - free, cached, free
        monkeypatch.setattr(FullPages, "usage", wrong_usage)
    h = Harness(fake_artifact(batch_ladder=(1, 2, 4), num_blocks=13), host_bytes=1 << 30,
                preempt_wait_s=1000.0)  # 12 pages: four choices of up to 7 outgrow them
    check = HeldGauges(h.batcher)
    h.batcher._observers.append(check)
    n_choices_then_a_turn(h)
    assert h.batcher.stats.preemptions > 0
    assert all(check.seen.values()), check.seen
    if variant != "as served":
        assert check.disagreed, "the control agreed: the check cannot fail"
        return
    assert check.disagreed == []
    used, cached, free = h.batcher.pool_state()[FULL]
    assert (used, len(h.batcher.sequences)) == (0, 0) and cached > 0

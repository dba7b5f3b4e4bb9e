"""The metrics writer (updates applied on its own thread) and the small outputs."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from triton_tlaloc.triton.metrics import MetricsWriter
from triton_tlaloc.triton.outputs import cache_salt_parameter, small_outputs, top_k_parameter


def test_metrics_writer_applies_updates_on_its_own_thread_in_batches():
    """metrics.MetricsWriter: counters summed, a gauge's last value, observations in order, all
    applied by its thread (nothing on the caller's), and a last flush at close."""
    class Fake:
        def __init__(self):
            self.calls, self.threads = [], set()

        def _record(self, kind, v):
            self.calls.append((kind, v))
            self.threads.add(threading.current_thread().name)

        def increment(self, v):
            self._record("increment", v)

        def set(self, v):
            self._record("set", v)

        def observe(self, v):
            self._record("observe", v)

    counter, gauge, hist = Fake(), Fake(), Fake()
    writer = MetricsWriter(interval_s=0.5)  # first flush well after the updates below
    for v in (1, 2, 3.5):
        writer.increment(counter, v)
        writer.set(gauge, v)
        writer.observe(hist, v)
    assert counter.calls == gauge.calls == hist.calls == []  # nothing on the caller's thread
    deadline = time.monotonic() + 5
    while not counter.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counter.calls == [("increment", 6.5)]
    assert gauge.calls == [("set", 3.5)]
    assert hist.calls == [("observe", 1), ("observe", 2), ("observe", 3.5)]
    assert counter.threads == {"tlaloc-metrics"}
    writer.increment(counter, 4)
    writer.close()  # flushes what is left
    assert counter.calls[-1] == ("increment", 4)


def test_small_outputs_argmax_and_top_k():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=1000).astype(np.float32)
    logits[[7, 8]] = 9.0  # a tie at the top: the lower id first, as argmax
    out = small_outputs(logits, {"ARGMAX", "TOP_K_IDS", "TOP_K_LOGPROBS"}, 5)
    assert out["ARGMAX"].tolist() == [[7]]
    want = np.argsort(-logits, kind="stable")[:5]
    assert out["TOP_K_IDS"].tolist() == [want.tolist()]
    z = logits.astype(np.float64)
    logsoftmax = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(out["TOP_K_LOGPROBS"][0], logsoftmax[want], rtol=1e-6)
    assert set(small_outputs(logits, {"ARGMAX"}, 5)) == {"ARGMAX"}
    assert small_outputs(logits, {"LOGITS"}, 5) == {}
    assert top_k_parameter(None, 1000) == 8 and top_k_parameter('{"top_k": 3}', 1000) == 3
    for bad in ('{"top_k": 0}', '{"top_k": 1001}', '{"top_k": "3"}', '{"top_k": true}'):
        with pytest.raises(ValueError, match="parameter top_k"):
            top_k_parameter(bad, 1000)
    assert cache_salt_parameter(None) is None and cache_salt_parameter({"top_k": 3}) is None
    assert cache_salt_parameter('{"cache_salt": "tenant"}') == "tenant"
    for bad in ('{"cache_salt": ""}', '{"cache_salt": 7}', '{"cache_salt": "%s"}' % ("x" * 257)):
        with pytest.raises(ValueError, match="parameter cache_salt: expected a string of 1 to 256"):
            cache_salt_parameter(bad)
    # A NUL would end the salt inside Triton: 'g\0one' and 'g\0two' would share cached KV.
    for bad, code in (("g\0one", "U+0000"), ("tenant\n", "U+000A"), ("a\x7fb", "U+007F")):
        with pytest.raises(ValueError, match=re.escape(f"parameter cache_salt: holds the "
                                                       f"control character {code}")):
            cache_salt_parameter({"cache_salt": bad})
    assert cache_salt_parameter({"cache_salt": "tenant é 7"}) == "tenant é 7"
    # The CACHE_SALT input's bytes carry what a parameter cannot: salts differing after a NUL
    # are different keys, neither a string salt's; printable UTF-8 is that string's salt.
    keys = [cache_salt_parameter({}, raw) for raw in (b"g\0one", b"g\0two", b"g", b"\xff")]
    assert keys[2] == "g" and len(set(keys)) == 4 and "g" not in keys[:2]
    assert all(k.startswith("\x01") for k in (keys[0], keys[1], keys[3]))
    with pytest.raises(ValueError, match="cache salt given twice"):
        cache_salt_parameter({"cache_salt": "g"}, b"g")
    for raw in (b"", b"x" * 1025):
        with pytest.raises(ValueError, match="input CACHE_SALT: expected 1 to 1024 bytes"):
            cache_salt_parameter({}, raw)

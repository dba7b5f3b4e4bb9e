"""The faults table (checks/abuse_faults.py): adapter loads without the admin key or with bad
paths and adapters, an adapter whose logits are NaN followed by 64 base-model streams, cache
salts carried whole, grammars, prompt logprobs and the page metrics, each against a real
tritonserver and tlaloc openai while other streams run: the bad request answered by name, the
streams' ids their solo ids, nothing left held, the adapters and the cache as they were."""

from __future__ import annotations

import pytest

from checks import abuse_faults as F
from checks.built_once import built_once

pytestmark = pytest.mark.tritonserver

@pytest.fixture(scope="module")
def target(run_dir, work):
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    art = built_once(run_dir / "smollm2-faults", lambda p: export_artifact(
        smollm2_gguf_path(), p, ExportOptions(**F.EXPORT)))
    t, stop = F.start_fault_target(art, work / "faults")
    yield t
    stop()


@pytest.mark.parametrize("case", F.CASES, ids=[c[2].__name__[5:] for c in F.CASES])
def test_fault_case(target, case):
    inp, expected, fn = case
    r = F.run_fault_case(target, fn)
    assert r["ok"], f"{inp}: expected {expected}, observed {r['observed']}"
    assert r["ready"], f"{inp}: the server is not ready after it"
    assert r["streams_equal"] and not r["left"], f"{inp}: {r['observed']}"

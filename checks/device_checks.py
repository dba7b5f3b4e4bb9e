"""Server checks for models on more than one device: a tensor-parallel model's bytes on each
device, and data-parallel instances sharing the sequences. tests/test_devices_server.py and
scripts/verify.py run them."""

from __future__ import annotations

import re
import uuid

import numpy as np
from checks.sequence_checks import Conditions, greedy_together, run_parallel

from triton_tlaloc.frontends.client import METRICS_SETTLE_S, generate, scrape_metrics
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import numpy_dtype


def series(values: dict, name: str, **labels) -> dict[tuple, float]:
    """A scraped metric's series whose labels include `labels`, keyed by their labels."""
    want = {(k, str(v)) for k, v in labels.items()}
    return {ls: v for (n, ls), v in values.items() if n == name and want <= set(ls)}


def label(labels: tuple, key: str) -> str:
    return dict(labels)[key]


def check_split_bytes(metrics_url, model, art, one_art):
    """tlaloc_device_bytes of a model exported for N devices: one series per device for each
    kind; each device's KV pools are the one-device artifact's over N (times the devices that
    hold each KV head), and its weights the replicated ones plus 1/N of the split ones."""
    values = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    a, one = load_artifact(art), load_artifact(one_art)
    tp = a.tensor_parallel
    n = tp.devices
    cond = Conditions()
    kv = series(values, "tlaloc_device_bytes", model=model, what="kv_pools")
    weights = series(values, "tlaloc_device_bytes", model=model, what="weights")
    cond(sorted(label(ls, "device") for ls in kv) == [str(d) for d in range(n)],
         f"KV series by device {sorted(label(ls, 'device') for ls in kv)}")
    one_kv = sum(_bytes(p) for p in one.pools)
    cond(all(v * n == one_kv * tp.kv_head_copies for v in kv.values()),
         f"KV bytes a device {sorted(kv.values())}, not {one_kv * tp.kv_head_copies // n}")
    split = sum(w.byte_length for w in a.weights if w.slot in tp.weights)
    rest = sum(w.byte_length for w in a.weights) - split
    cond(all(rest + split // n <= v <= rest + split * tp.kv_head_copies // n
             for v in weights.values()),
         f"weight bytes a device {sorted(weights.values())}, replicated {rest}, split {split}")
    return cond.result(f"{n} devices: KV {min(kv.values()) / 2**10:.0f} KiB and weights "
                       f"{min(weights.values()) / 2**10:.0f} KiB each (one device: KV "
                       f"{one_kv / 2**10:.0f} KiB, weights {(rest + split) / 2**10:.0f} KiB)")


def _bytes(pool) -> int:
    return int(np.prod(pool.shape)) * numpy_dtype(pool.dtype).itemsize


def check_data_parallel(url, protocol, model, prompts, want, steps, metrics_url, instances):
    """Sequences sent together to a model of several instances: each gives its solo ids (a
    step on an instance that does not hold its sequence would be refused), and every instance
    ran prompts (tlaloc_tokens_total by instance). The run has a cache salt of its own: with
    KV reuse, prompts cached by an earlier run (the other protocol's) run no prefill tokens."""
    salt = f"spread-{uuid.uuid4().hex}"
    return _spread(lambda: greedy_together(url, protocol, model, prompts, steps,
                                           cache_salt=salt), model, want, metrics_url, instances)


def check_generate_spread(grpc_url, model, prompts, want, metrics_url, instances):
    """Generations sent together to `model`'s generate model, whose sequence model has several
    instances: each gives the solo ids, and the generate model's local links reach every
    instance (prompt tokens run on each). With a cache salt of its own, as above."""
    salt = f"spread-{uuid.uuid4().hex}"

    def together():
        got = [None] * len(prompts)

        def one(i):
            got[i] = generate(grpc_url, f"{model}_generate", input_ids=prompts[i],
                              sampling={"max_tokens": len(want[i]), "ignore_eos": True,
                                        "cache_salt": salt}).token_ids
        run_parallel(one, len(prompts))
        return got
    return _spread(together, model, want, metrics_url, instances)


def _spread(send_together, model, want, metrics_url, instances):
    """send_together() -> each prompt's ids: all equal to `want`, and every one of `instances`
    ran prompt tokens meanwhile."""
    before = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    got = send_together()
    after = scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)
    cond = Conditions()
    equal = sum(g == w for g, w in zip(got, want))
    cond(equal == len(want), f"{equal}/{len(want)} equal")
    ran = _ran_by_instance(before, after, model)
    cond(len(ran) == instances and all(v > 0 for v in ran.values()),
         f"prompt tokens by instance {ran}: not every one of {instances} ran prompts")
    return cond.result(f"{equal}/{len(want)} equal; prompt tokens by instance {_short(ran)}")


def _ran_by_instance(before: dict, after: dict, model: str) -> dict[str, float]:
    ran = {}
    for ls, v in series(after, "tlaloc_tokens_total", model=model, kind="prefill").items():
        ran[label(ls, "instance")] = v - before.get(("tlaloc_tokens_total", ls), 0)
    return ran


def _short(ran: dict) -> dict:
    return {re.sub(r"^.*_", "#", k): int(v) for k, v in sorted(ran.items())}

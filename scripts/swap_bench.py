#!/usr/bin/env python3
"""The host tier's cost: swapping a sequence's KV out to host memory and back in, against
recomputing it (prefilling the same prompt again, what a backend without a host tier pays to
bring a dropped sequence back), side by side in one run.

SmolLM2-135M-Instruct f32 (exported once into --work, shared with scripts/prefix_bench.py),
its entries and the page transfer programs compiled first. For each prompt length: a warm-up
sequence, then --reps sequences of fresh seeded ids; each is prefilled (timed: recompute),
swapped out (timed) and swapped in (timed) by the server's own HostTier over the runtime's
pools (prefix reuse off, so every page is written back). Figures are medians; per page and per
MiB too.

Then the host tier as a prefix cache (prefix reuse on): for each length, a prompt whose first
blocks are a known prefix (all but its last 16 tokens) is answered (time to its first logits)
with the prefix computed (cold), found on the device, and found on the host after a
reservation of the whole pool evicted it from the device. Nothing else should run on the
machine. Writes JSON into --work.

    .venv/bin/python scripts/swap_bench.py [--reps 5] [--lengths 64,256,512,1000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from prefix_bench import export, log  # noqa: E402

from triton_tlaloc.engine.core import Engine, Sequence  # noqa: E402
from triton_tlaloc.kv.host_tier import HostTier  # noqa: E402
from triton_tlaloc.runtime.kv_transfer import PageTransfer, transfer_buckets  # noqa: E402
from triton_tlaloc.runtime.core import Runtime  # noqa: E402


def one(engine: Engine, host: HostTier, prompt: list[int]) -> dict:
    seq = Sequence([])
    t0 = time.perf_counter()
    engine.admit(seq, prompt)
    engine.prefill_chunked(seq)
    recompute = time.perf_counter() - t0
    pages = len(seq.pages)
    out = host.swap_out(seq)
    back = host.swap_in(seq)
    assert back.shared == 0 and back.pages == pages
    engine.free(seq)
    return {"recompute": recompute, "out": out.seconds, "in": back.seconds, "pages": pages,
            "bytes": out.nbytes}


def first_logits(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to a START's first logits, and how many of its tokens came from the host."""
    seq = Sequence([])
    t0 = time.perf_counter()
    reuse = engine.admit(seq, prompt)
    engine.prefill_chunked(seq)
    seconds = time.perf_counter() - t0
    engine.free(seq)
    return seconds, reuse.from_host


def evict_everything(engine: Engine) -> None:
    """Take every page (evicting every cached block: the host tier copies them) and free them."""
    hog = Sequence([])
    engine.blocks.reserve(hog, engine.blocks.full.capacity * engine.blocks.block_size)
    engine.free(hog)


def prefix_row(engine: Engine, rng: random.Random, n: int, vocab: int, reps: int) -> dict:
    """A prompt of n tokens whose leading blocks were computed before, found where?"""
    bs = engine.blocks.block_size
    runs = []
    for rep in range(reps + 1):  # the first is a warm-up
        prefix = [rng.randrange(100, vocab) for _ in range((n - 16) // bs * bs)]

        def tail():
            return [rng.randrange(100, vocab) for _ in range(n - len(prefix))]
        cold, _ = first_logits(engine, prefix + tail())
        device, _ = first_logits(engine, prefix + tail())
        evict_everything(engine)
        host, from_host = first_logits(engine, prefix + tail())
        assert from_host == len(prefix), (from_host, len(prefix))
        if rep:
            runs.append({"cold": cold, "device": device, "host": host})
    med = {k: statistics.median(r[k] for r in runs) for k in ("cold", "device", "host")}
    return {"tokens": n, "prefix_tokens": (n - 16) // bs * bs,
            **{f"{k}_ms": v * 1e3 for k, v in med.items()},
            "host_over_cold": med["host"] / med["cold"],
            "host_over_device": med["host"] / med["device"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", default="64,256,512,1000")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "prefix-bench")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    art = export(args.work, (1, 2), (256, 1024))
    rt = Runtime(art)
    engine = Engine(rt)
    transfer = PageTransfer(rt)
    t0 = time.perf_counter()
    transfer.warm(transfer_buckets(rt.artifact))
    log(f"transfer programs compiled in {time.perf_counter() - t0:.1f} s")
    host = HostTier(engine.blocks, transfer, 1 << 40)
    vocab = rt.artifact.model.vocab
    rng = random.Random(args.seed)
    rows = []
    for n in lengths:
        one(engine, host, [rng.randrange(100, vocab) for _ in range(n)])  # warm-up
        runs = [one(engine, host, [rng.randrange(100, vocab) for _ in range(n)])
                for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("recompute", "out", "in")}
        pages, nbytes = runs[0]["pages"], runs[0]["bytes"]
        rows.append({"tokens": n, "pages": pages, "mib": nbytes / 2**20,
                     **{f"{k}_ms": v * 1e3 for k, v in med.items()},
                     "out_ms_per_page": med["out"] * 1e3 / pages,
                     "in_ms_per_page": med["in"] * 1e3 / pages,
                     "in_over_recompute": med["in"] / med["recompute"],
                     "out_plus_in_over_recompute": (med["out"] + med["in"]) / med["recompute"]})
        log(f"{n} tokens done")
    m = rt.artifact.model
    ran = (f"SmolLM2-135M-Instruct f32, KV {m.kv_dtype}, pages of {m.block_size} tokens "
           f"({host.page_bytes['full'] / 2**10:.0f} KiB a page), CPU PJRT; medians of "
           f"{args.reps} sequences per length after a warm-up; transfers in place "
           f"{transfer.in_place}, copied {transfer.copied}")
    print(ran)
    head = (f"{'tokens':>7} {'pages':>6} {'MiB':>6} {'recompute':>10} {'swap out':>9} "
            f"{'swap in':>8} {'out/page':>9} {'in/page':>8} {'in/recompute':>13} "
            f"{'(out+in)/recompute':>19}")
    print(head)
    for r in rows:
        print(f"{r['tokens']:>7} {r['pages']:>6} {r['mib']:>6.1f} {r['recompute_ms']:>8.1f}ms "
              f"{r['out_ms']:>7.1f}ms {r['in_ms']:>6.1f}ms "
              f"{r['out_ms_per_page']:>7.2f}ms {r['in_ms_per_page']:>6.2f}ms "
              f"{r['in_over_recompute']:>12.3f}x {r['out_plus_in_over_recompute']:>18.3f}x")
    reuse = Engine(rt, prefix_reuse=True)
    host = HostTier(reuse.blocks, transfer, 1 << 40)
    prefix_rows = []
    for n in lengths:
        prefix_rows.append(prefix_row(reuse, rng, n, vocab, args.reps))
        log(f"{n} tokens done (prefix)")
    print("a prompt whose leading blocks (all but its last 16 tokens) are computed, found on "
          "the device, or found on the host: time to its first logits")
    print(f"{'tokens':>7} {'prefix':>7} {'computed':>9} {'device':>8} {'host':>8} "
          f"{'host/computed':>14} {'host/device':>12}")
    for r in prefix_rows:
        print(f"{r['tokens']:>7} {r['prefix_tokens']:>7} {r['cold_ms']:>7.1f}ms "
              f"{r['device_ms']:>6.1f}ms {r['host_ms']:>6.1f}ms {r['host_over_cold']:>13.3f}x "
              f"{r['host_over_device']:>11.2f}x")
    out = args.work / "swap_bench.json"
    out.write_text(json.dumps({"ran": ran, "rows": rows, "prefix_rows": prefix_rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

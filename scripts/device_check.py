#!/usr/bin/env python3
"""One prepared run for a lent accelerator (docs/design.md#numpy-and-jax-versions): its image
has jax with the CUDA plugin, torch and transformers, but no tritonserver and no numpy<2, so this
checks the no-server path on PJRT's device platform and prints a table (check, observed,
PASS/FAIL):

1. parity: a seeded tiny llama (transformers) exported here and run on the device: 16 greedy
   ids equal transformers', first logits within 1e-3 of the largest;
2. speed: a SmolLM2-135M-shaped random llama (30 layers, hidden 576, vocab 49,152, tied),
   f32 and bf16 weights, one sequence: prompt time and decode ms per token (median of 32)
   against the weight-bytes floor at the device's copy rate (--bandwidth-gbs, H200 ~4,300),
   and a decode step of 1, 4 and 8 rows (median of 16) with its parts (the runtime's inputs,
   executable and copy, and the engine's own), also with the f32 layers unrolled;
3. programs: a generic program at two row widths batched by shape, nine dtypes plus one, a
   running-sum state kept in place, and a bounded masked mean at every length 1-16;
4. tensor parallel, when the machine has 2 or more devices: the tiny llama exported for 2 (and
   4) devices gives the one-device artifact's ids and logits (1e-5 of the largest), with its
   pools in place on every device. With one device the row is listed as not run.

Runs on the CPU too (`--platform cpu`: how it is tested where there is no GPU).

    PYTHONPATH=. python3 scripts/device_check.py [--platform cuda] [--out DIR] [--skip-speed]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def run(self, check: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            observed, ok = fn()
        except Exception as e:
            traceback.print_exc()
            observed, ok = f"{type(e).__name__}: {e}", False
        row = {"check": check, "observed": observed, "ok": bool(ok),
               "seconds": round(time.perf_counter() - t0, 1)}
        self.rows.append(row)
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {observed} ({row['seconds']} s)", flush=True)


def parity(work: Path, platform: str):
    from checks.oracle import load_reference, logits_error, make_tiny_checkpoint, reference_greedy

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.runtime.core import Runtime

    ckpt = make_tiny_checkpoint(work / "tiny-llama", "llama")
    art = export_artifact(ckpt, work / "art-tiny", ExportOptions(
        batch_ladder=(1,), context_ladder=(64,), block_size=8))
    want_ids, want_logits = reference_greedy(load_reference(ckpt), PROMPT, 16)
    engine = Engine(Runtime(art, platform=platform))
    seq = engine.new_sequence(PROMPT)
    first = engine.prefill_chunked(seq)[0]
    engine.free(seq)
    ids = engine.generate_greedy(PROMPT, 16).generated_ids
    err = logits_error(first, want_logits)
    same = sum(a == b for a, b in zip(ids, want_ids))
    return f"{same}/16 ids equal transformers', first logits {err:.1e} of the largest", \
        ids == want_ids and err <= 1e-3


def tensor_parallel(work: Path, platform: str, devices: int):
    from checks.oracle import logits_error, make_tiny_checkpoint

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.runtime.core import Runtime

    ckpt = work / "tiny-llama"
    if not ckpt.exists():
        make_tiny_checkpoint(ckpt, "llama")
    runs, observed, ok = {}, [], True
    for n in [1] + [n for n in (2, 4) if n <= devices]:
        art = export_artifact(ckpt, work / f"art-tp{n}", ExportOptions(
            batch_ladder=(1, 2), context_ladder=(64,), block_size=8, prefill_chunk=16,
            tensor_parallel=n))
        rt = Runtime(art, platform=platform)
        engine = Engine(rt)
        seq = engine.new_sequence(PROMPT)
        first = engine.prefill_chunked(seq)[0]
        engine.free(seq)
        runs[n] = (first, engine.generate_greedy(PROMPT, 16).generated_ids, rt.donation)
        if n > 1:
            err = logits_error(first, runs[1][0])
            d = rt.donation
            same = runs[n][1] == runs[1][1]
            ok = ok and same and err <= 1e-5 and d.copied == 0 and d.in_place == d.runs
            observed.append(f"{n} devices: ids {'equal' if same else 'differ'}, logits "
                            f"{err:.1e} of the largest, pools in place {d.in_place}/{d.runs}")
    return "; ".join(observed), ok


def speed(work: Path, platform: str, bandwidth_gbs: float) -> list:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.export import ExportOptions, export_artifact
    from triton_tlaloc.runtime.core import Runtime

    torch.manual_seed(0)
    ckpt = work / "smollm2-shaped"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(ckpt)
    rows = []
    prompt = [(i * 37 + 11) % 49000 + 100 for i in range(48)]
    for dtype, loop in (("f32", True), ("bf16", True), ("f32", False)):
        name = f"{dtype}{'' if loop else ' unrolled'}"
        art = export_artifact(ckpt, work / f"art-{dtype}-{loop}", ExportOptions(
            batch_ladder=ROWS, context_ladder=(256,), prefill_tokens=(64,), weight_dtype=dtype,
            layer_loop=loop))
        rt = Runtime(art, platform=platform)
        engine = Engine(rt)
        engine.generate_greedy(prompt, 4)  # warm-up
        g = engine.generate_greedy(prompt, 33)
        floor_ms = rt.weight_bytes / (bandwidth_gbs * 1e9) * 1e3
        ms = g.median_ms_per_token
        steps = {n: decode_step_ms(engine, prompt, n) for n in ROWS}
        rows.append((name, rt.weight_bytes / 2**20, g.prefill_ms, ms, floor_ms, steps))
    return rows


ROWS = (1, 4, 8)  # the speed row's decode batches: rows run as one product each up to 8


def decode_step_ms(engine, prompt: list[int], rows: int) -> str:
    """The median of 16 decode steps of `rows` sequences (after 2 untimed), each sequence the
    prompt with a token of its own in front; and the mean step's parts in the runtime (inputs
    put on the device, the executable, the logits copied back) and the rest in the engine."""
    from triton_tlaloc.kv.sequence import Sequence

    seqs = []
    for r in range(rows):
        seq = Sequence([])
        engine.admit(seq, [100 + r, *prompt])
        seq.token_ids.append(int(np.argmax(engine.prefill_chunked(seq)[0])))
        seqs.append(seq)
    times = []
    phases = engine.rt.phase_seconds
    for i in range(18):
        if i == 2:
            before = dict(phases)
        t0 = time.perf_counter()
        logits = engine.decode(seqs)
        times.append(time.perf_counter() - t0)
        for seq, row in zip(seqs, logits):
            seq.token_ids.append(int(np.argmax(row)))
    for seq in seqs:
        engine.free(seq)
    parts = {k: (phases[k] - before[k]) / 16 * 1e3 for k in ("inputs", "execute", "copy")}
    parts["engine"] = float(np.mean(times[2:])) * 1e3 - sum(parts.values())
    return (f"{float(np.median(times[2:])) * 1e3:.2f} ms (" +
            ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + ")")


def programs_on(work: Path, platform: str):
    from checks import programs as P

    from triton_tlaloc.programs.bounded import BoundedRuntime
    from triton_tlaloc.artifact.manifest import numpy_dtype
    from triton_tlaloc.programs.generic import (ARGUMENT_KINDS, RESULT_KINDS, ProgramRuntime,
                                                parse_bindings, run_batch)

    built = P.build_programs(work / "programs")
    out = []

    def bind(a, r):
        return parse_bindings(a, ARGUMENT_KINDS, "arguments"), parse_bindings(r, RESULT_KINDS,
                                                                               "results")

    rows = ProgramRuntime(built["rows"], *bind("input:X,weight:scale.bin", "output:Y"),
                          platform=platform)
    rng = np.random.default_rng(0)
    xs = [rng.integers(-50, 50, (1, int(w))).astype(np.float32) for w in rng.choice((3, 5), 32)]
    answers = run_batch(rows, [{"X": x} for x in xs], group_by_shape=True, max_batch=32)
    exact = all(np.array_equal(a["Y"], x * P.ROW_SCALE + x.sum(-1, keepdims=True))
                for a, x in zip(answers, xs))
    out.append(("rows of widths 3 and 5, 32 requests", f"{rows.executions} executions, equal "
                f"to numpy: {exact}", exact and rows.executions == 2))

    dt = ProgramRuntime(built["dtypes"], *bind(",".join(f"input:{n}" for n in P.DTYPE_INPUTS),
                                               ",".join(f"output:{n}" for n in P.DTYPE_OUTPUTS)),
                        platform=platform)
    inputs = {n: (np.array([[True, False, True]]) if d == "i1" else
                  np.array([[0, 1, 7]]).astype(numpy_dtype(d)))
              for n, d in zip(P.DTYPE_INPUTS, P.DTYPES)}
    got = dt.run(inputs)
    good = [d for d, i, o in zip(P.DTYPES, P.DTYPE_INPUTS, P.DTYPE_OUTPUTS)
            if got[o].dtype == inputs[i].dtype
            and np.array_equal(got[o], P.expected_plus_one(inputs[i]))]
    out.append(("nine dtypes plus one", f"{len(good)}/9 ({', '.join(good)})", len(good) == 9))

    total = ProgramRuntime(built["running_sum"], *bind("input:X,state:total",
                                                      "output:TOTAL,state:total"),
                           platform=platform)
    steps = [rng.integers(-9, 10, 4).astype(np.float32) for _ in range(20)]
    kept = all(np.array_equal(total.run({"X": x})["TOTAL"], np.sum(steps[:k + 1], axis=0))
               for k, x in enumerate(steps))
    out.append(("running sum, 20 requests", f"kept {kept}; in place {total.state.in_place}/20",
                kept and total.state.in_place == 20))

    masked = BoundedRuntime(built["masked_mean"], platform=platform)
    worst = 0.0
    for n in range(1, P.BOUND + 1):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        worst = max(worst, float(np.max(np.abs(masked.run({"x": x})[0] - x.mean(0)))))
    out.append((f"bounded masked mean, lengths 1-{P.BOUND}", f"worst {worst:.1e}",
                worst <= 1e-5))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="where the JSON results go")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--bandwidth-gbs", type=float, default=4300.0,
                    help="the device's copy rate for the floor (H200: ~4,300 GB/s measured)")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    import jax

    work = args.work or Path(tempfile.mkdtemp(prefix="tlaloc-device-"))
    print(f"jax {jax.__version__}, numpy {np.__version__}, devices "
          f"{jax.devices(args.platform)}", flush=True)
    table = Table()
    table.run(f"{args.platform}: tiny llama parity", lambda: parity(work, args.platform))
    results = []
    table.run(f"{args.platform}: programs", lambda: (
        results.extend(programs_on(work, args.platform)) or
        ("; ".join(f"{c}: {o}" for c, o, _ in results), all(ok for *_, ok in results))))
    count = len(jax.devices(args.platform))
    if count > 1:
        table.run(f"{args.platform}: tensor parallel tiny llama",
                  lambda: tensor_parallel(work, args.platform, count))
    else:
        print(f"NOT RUN  {args.platform}: tensor parallel (one device)", flush=True)
    if not args.skip_speed:
        speeds = []

        def timed():
            speeds.extend(speed(work, args.platform, args.bandwidth_gbs))
            return ("; ".join(f"{d} {mib:.0f} MiB: prompt of 48 {p:.1f} ms, decode {ms:.2f} "
                              f"ms/token ({ms / floor:.1f}x the {floor:.3f} ms floor), a step "
                              f"of " + ", ".join(f"{n} rows {t}" for n, t in steps.items())
                              for d, mib, p, ms, floor, steps in speeds), True)
        table.run(f"{args.platform}: SmolLM2-shaped decode", timed)
    ok = all(r["ok"] for r in table.rows)
    print(f"\n{sum(r['ok'] for r in table.rows)} of {len(table.rows)} checks passed")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_check.json").write_text(json.dumps(table.rows, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

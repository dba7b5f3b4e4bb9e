"""One sequence's speed against llama.cpp on the same GGUF file: prompt tokens/s and decode
ms/token, llama.cpp (llama-cpp-python, installed into a venv of its own on first use, the file
as it is, 2 threads) beside `tlaloc run` on artifacts exported from that file (by default
`--weight-quant gguf`, the file's blocks kept packed; `int8` with the head quantized; `f32`;
`int4` on request: the file's values quantized again, 4-bit with a scale per 32, head too).

Every target gets the same prompt ids (a fresh text each round, the artifact's tokenizer) and
makes the same number of greedy tokens; the targets take turns within each round, and a figure
is the median over rounds (each round's decode figure is that run's median step). Run it on a
quiet machine.

    .venv/bin/python scripts/vs_llamacpp.py [--gguf FILE] [--rounds 3] [--prompt-words 400]
        [--steps 64] [--targets llamacpp,gguf,int8,f32] [--quantize Q4_K_M]

`--quantize TYPE` first writes the file in another of llama.cpp's types with llama.cpp's own
quantizer (`llama_model_quantize`, requantizing the file's values: SmolLM2 ships only as Q4_1)
and measures that file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from openai_bench import LLAMACPP, venv  # noqa: E402  (the same pinned llama.cpp)

EXPORTS = {"gguf": ["--weight-quant", "gguf"],
           "int4": ["--weight-quant", "int4", "--quant-head"],
           "int8": ["--weight-quant", "int8", "--quant-head"],
           "f32": []}
WORDS = ("river mountain cloud rain storm valley forest ocean wind stone light shadow morning "
         "evening harvest village market bridge tower garden lantern meadow harbor").split()

# Runs inside llama.cpp's venv: llama.cpp's quantizer, from one GGUF file to another type.
QUANTIZE_WORKER = r"""
import sys
import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.allow_requantize = True
params.nthread = 2
assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) == 0
"""

# Runs inside llama.cpp's venv: the prompt in one eval, then greedy steps of one token.
LLAMACPP_WORKER = r"""
import json, statistics, sys, time
import llama_cpp
import numpy as np
from llama_cpp import Llama
path, ids, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=2048, verbose=False)
llm.eval(ids[:8]); llm.reset()  # warm up
t0 = time.perf_counter()
llm.eval(ids)
prefill = time.perf_counter() - t0
out, step_s = [], []
for _ in range(steps):
    # the last position's logits (Llama.scores stays zero unless every position's is kept)
    last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    token = int(np.argmax(np.ctypeslib.as_array(last, shape=(llm.n_vocab(),))))
    out.append(token)
    t0 = time.perf_counter()
    llm.eval([token])
    step_s.append(time.perf_counter() - t0)
print(json.dumps({"prefill_ms": prefill * 1e3, "ms_per_token": statistics.median(step_s) * 1e3,
                  "generated_ids": out}))
"""


def log(msg: str) -> None:
    print(f"[vs_llamacpp] {msg}", file=sys.stderr, flush=True)


def export(gguf: Path, name: str, work: Path, context: int) -> Path:
    out = work / name
    if not (out / "tlaloc-serving.json").is_file():
        log(f"exporting {name} from {gguf.name} ...")
        subprocess.run([str(ROOT / ".venv" / "bin" / "tlaloc"), "export", str(gguf), str(out),
                        "--batch-ladder", "1", "--context-ladder", str(context),
                        "--verify-tokens", "", *EXPORTS[name]], check=True,
                       stderr=subprocess.DEVNULL)
    return out


def run_tlaloc(art: Path, ids: list[int], steps: int) -> dict:
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "tlaloc"), "run", str(art),
                           "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens",
                           str(steps), "--ignore-eos", "--warmup-runs", "1", "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def run_llamacpp(bin_dir: Path, gguf: Path, ids: list[int], steps: int) -> dict:
    proc = subprocess.run([str(bin_dir / "python"), "-c", LLAMACPP_WORKER, str(gguf),
                           json.dumps(ids), str(steps)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2's Q4_1 file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=400)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--targets", default="llamacpp,gguf,int8,f32")
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "vs-llamacpp")
    ap.add_argument("--quantize", default=None, help="a llama.cpp type, e.g. Q4_K_M")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path
    from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer

    gguf = (args.gguf or smollm2_gguf_path()).resolve()
    targets = args.targets.split(",")
    bin_dir = venv(ROOT / "artifacts" / "openai-bench" / "llamacpp-venv", [LLAMACPP]) \
        if "llamacpp" in targets or args.quantize else None
    if args.quantize:
        out = args.work / f"{gguf.stem.rsplit('.', 1)[0]}.{args.quantize}.gguf"
        if not out.is_file():
            log(f"writing {out.name} with llama.cpp's quantizer ...")
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(bin_dir / "python"), "-c", QUANTIZE_WORKER, str(gguf), str(out),
                            args.quantize], check=True)
        gguf = out
    work = args.work / gguf.stem
    arts = {t: export(gguf, t, work, 1024) for t in targets if t in EXPORTS}
    tok = ArtifactTokenizer(next(iter(arts.values())) / "tokenizer") if arts else None
    results: dict[str, list[dict]] = {t: [] for t in targets}
    for r in range(args.rounds):
        rng = random.Random(r)
        text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        ids = tok.encode(text) if tok else []
        for t in targets:
            res = (run_llamacpp(bin_dir, gguf, ids, args.steps) if t == "llamacpp"
                   else run_tlaloc(arts[t], ids, args.steps))
            results[t].append(res)
            log(f"round {r}: {t}: prompt {res['prefill_ms']:.0f} ms, "
                f"{res['ms_per_token']:.2f} ms/token")
    n_prompt = len(ids)
    print(f"\n{gguf.name}, {n_prompt}-token prompts, {args.steps} greedy tokens, 2 threads, "
          f"medians of {args.rounds} rounds\n")
    print(f"{'target':<10}{'weights MiB':>12}{'prompt tok/s':>14}{'decode ms/token':>17}"
          f"{'decode / llama.cpp':>20}{'prompt time / llama.cpp':>25}")
    base = results.get("llamacpp")
    base_dec = statistics.median(x["ms_per_token"] for x in base) if base else None
    base_pre = statistics.median(x["prefill_ms"] for x in base) if base else None
    for t in targets:
        dec = statistics.median(x["ms_per_token"] for x in results[t])
        pre = statistics.median(x["prefill_ms"] for x in results[t])
        size = (gguf.stat().st_size if t == "llamacpp" else sum(
            p.stat().st_size for p in (arts[t] / "weights").iterdir())) / 2**20
        ratios = (f"{dec / base_dec:>19.2f}x{pre / base_pre:>24.2f}x" if base else "")
        print(f"{t:<10}{size:>12.1f}{n_prompt / pre * 1e3:>14.0f}{dec:>17.2f}{ratios}")
    if base and "gguf" in results:
        same = sum(a == b for a, b in zip(base[-1]["generated_ids"],
                                          results["gguf"][-1]["generated_ids"]))
        print(f"\nlast round: gguf's greedy ids equal llama.cpp's at {same} of {args.steps} "
              f"positions (llama.cpp rounds each product's input to 8 bits, so its greedy "
              f"path may part from the exact one)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

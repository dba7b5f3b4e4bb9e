"""What each `tlaloc` subcommand does, given its parsed arguments (parsers.py): each imports
what it needs when it runs, so `tlaloc --help` loads no JAX."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def report(args, prompt_ids, generated_ids, text, finish_reason, prefill_ms, ms_per_token,
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


def cmd_export(args) -> int:
    from ..export.options import ExportOptions
    from ..export.writer import export_artifact
    from ..runtime.pjrt import cpu_devices

    if args.precompile and args.platform == "cpu":
        cpu_devices(args.tensor_parallel)  # before the export starts JAX

    opts = ExportOptions(batch_ladder=args.batch_ladder, context_ladder=args.context_ladder,
                         prefill_max_batch=args.prefill_max_batch or None, block_size=args.block_size,
                         num_blocks=args.num_blocks, weight_dtype=args.weight_dtype,
                         weight_quant=args.weight_quant, quant_head=args.quant_head,
                         quant_group=args.quant_group, quant_zero_point=args.quant_zero_point,
                         kv_dtype=args.kv_dtype,
                         model_name=args.model_name, prefill_chunk=args.prefill_chunk or None,
                         prefill_tokens=args.prefill_tokens,
                         verify_tokens=args.verify_tokens, mixed_tokens=args.mixed_tokens,
                         mixed_batches=args.mixed_batches,
                         windowed_kv=None if args.windowed_kv is None else args.windowed_kv == "true",
                         ring_spare_pages=args.ring_spare_pages, window_blocks=args.window_blocks,
                         state_slots=args.state_slots, layer_loop=not args.no_layer_loop,
                         in_out_copy=not args.no_in_out_copy,
                         tensor_parallel=args.tensor_parallel,
                         replicate_vocab=args.replicate_vocab,
                         max_lora_rank=args.max_lora_rank, lora_slots=args.lora_slots,
                         **{name: block for name, block in (
                             ("attention_block", args.attention_block),
                             ("decode_attention_block", args.decode_attention_block),
                             ("many_rows_attention_block", args.many_rows_attention_block))
                            if block is not None})
    checkpoint = args.checkpoint
    if checkpoint == "smollm2":
        from ..export.gguf_checkpoint import smollm2_gguf_path

        checkpoint = smollm2_gguf_path()
    export_artifact(checkpoint, args.out, opts)
    if args.precompile:
        _precompile(args.out, args)
    return 0


def _precompile(artifact_dir, args) -> None:
    from ..artifact.loading import load_artifact
    from ..runtime.pjrt import cpu_devices
    from ..runtime.precompile import precompile

    artifact = load_artifact(artifact_dir)
    if args.platform == "cpu":
        cpu_devices(artifact.devices)

    stats = precompile(artifact, platform=args.platform,
                       cache_dir=Path(args.compile_cache_dir) if args.compile_cache_dir else None,
                       workers=args.workers)
    print(f"compile cache ready: {stats.compiled} programs compiled, {stats.cache_hits} were "
          f"there already, {stats.seconds:.0f} s of compiling")


def cmd_compile(args) -> int:
    _precompile(args.artifact, args)
    return 0


def _run_adapter(args, rt) -> tuple[int, str]:
    """`tlaloc run --lora DIR`: the adapter written into slot 1 (its slot and identity), or
    (0, "") without one."""
    if not args.lora:
        return 0, ""
    from ..lora.peft_adapter import AdapterError, read_peft_adapter

    if rt.adapters is None:
        raise AdapterError(f"--lora {args.lora}: the artifact takes no adapters (export it "
                           f"with --max-lora-rank)")
    adapter = read_peft_adapter(args.lora, rt.artifact.lora)
    seconds = rt.adapters.write(1, adapter.arrays)
    print(f"adapter {args.lora}: rank {adapter.rank}, {adapter.nbytes / 2**20:.1f} MiB, "
          f"written into slot 1 in {seconds * 1e3:.1f} ms", file=sys.stderr)
    return 1, adapter.content_hash


def _run_stdlib(args) -> int:
    """`tlaloc run --runtime capi --stdlib`: runtime/stdlib_runner.py, no numpy imported."""
    from ..runtime.stdlib_runner import StdlibRunner

    others = [flag for flag, on in (("--prompt (it needs a tokenizer: give --prompt-ids)",
                                     args.prompt is not None), ("--chat", args.chat),
                                    ("--follow-up", args.follow_up), ("--lora", args.lora),
                                    ("--speculate", args.speculate), ("--devices", args.devices))
              if on]
    if args.runtime != "capi" or others:
        raise SystemExit(f"tlaloc run --stdlib: runs with --runtime capi and --prompt-ids alone"
                         f"{'; not ' + ', '.join(others) if others else ''}")
    runner = StdlibRunner(args.artifact, plugin=args.plugin, donate=not args.no_donate)
    stop = () if args.ignore_eos else tuple(runner.art.model.eos_token_ids)
    for _ in range(args.warmup_runs):
        runner.generate_greedy(args.prompt_ids, min(args.max_new_tokens, 2), stop)
    calls = runner.calls
    result = runner.generate_greedy(args.prompt_ids, args.max_new_tokens, stop)
    report(args, result.prompt_ids, result.generated_ids, None, result.finish_reason,
           result.prefill_ms, result.median_ms_per_token, "standard library: ", {
               "decode_ms": [round(x, 3) for x in result.decode_ms_per_token],
               "calls": runner.calls - calls, "pools_in_place": runner.in_place,
               "pools_copied": runner.copied})
    return 0


def cmd_run(args) -> int:
    if args.stdlib:
        return _run_stdlib(args)
    from ..engine.core import Engine
    from ..generation.drafting import prompt_lookup
    from ..runtime.pjrt import cpu_devices
    from ..runtime.core import Runtime

    from ..artifact.loading import load_artifact

    artifact = load_artifact(args.artifact)
    # One sequence: only the smallest batch's entries (verify entries only to speculate).
    batch = min(artifact.batch_ladder)
    entries = sorted(e.name for e in artifact.entries.values() if e.batch == batch
                     and (args.speculate or e.kind != "verify"))
    devices = args.devices or tuple(range(artifact.devices))
    capi = args.runtime == "capi"
    if args.plugin and not capi:
        raise SystemExit("tlaloc run: --plugin is --runtime capi's")
    if args.platform == "cpu" and not capi:
        cpu_devices(max(devices) + 1)
    # Each entry compiled the first time a call needs it (a short run touches one context);
    # with warm-up runs every one now, so no compile falls in the timed run.
    rt = Runtime(artifact, platform=args.platform, donate=not args.no_donate, entries=entries,
                 devices=devices, plugin=(args.plugin or "") if capi else None,
                 first_use=not args.warmup_runs)
    # KV reuse only to show it (--follow-up): warm-up runs must not make the timed one cached.
    engine = Engine(rt, prefix_reuse=bool(args.follow_up))
    tok = None
    if args.prompt is not None:
        from ..frontends.tokenizer import ArtifactTokenizer

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
    adapter = _run_adapter(args, rt)
    for _ in range(args.warmup_runs):  # benchmarks: the timed run finds everything warm
        engine.generate_greedy(prompt_ids, min(args.max_new_tokens, 2), tuple(sorted(stop)),
                               adapter=adapter)
    executions = engine.executions
    result = engine.generate_greedy(prompt_ids, args.max_new_tokens, tuple(sorted(stop)),
                                    speculate=args.speculate, drafter=prompt_lookup,
                                    adapter=adapter)
    text = tok.decode(result.generated_ids) if tok is not None else None
    # Speculating, a call yields several tokens: the time a token is the calls' over them.
    per_token = (sum(result.decode_ms_per_token) / max(1, len(result.generated_ids) - 1)
                 if args.speculate else result.median_ms_per_token)
    report(args, result.prompt_ids, result.generated_ids, text, result.finish_reason,
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
        from .parsers import int_list

        ids = list(prompt_ids) + first.generated_ids + list(int_list(args.follow_up))
    result = engine.generate_greedy(ids, args.max_new_tokens, tuple(sorted(stop)))
    text = tok.decode(result.generated_ids) if tok is not None else None
    report(args, result.prompt_ids, result.generated_ids, text, result.finish_reason,
            result.prefill_ms, result.median_ms_per_token,
            f"follow-up, {result.reused_tokens} tokens reused: ", {
                "reused_tokens": result.reused_tokens,
                "first_prefill_ms": round(first.prefill_ms, 2)})


def _is_program(source: str) -> bool:
    from ..programs.bounded import BOUNDED_MANIFEST

    path = Path(source)
    return path.is_file() or (path / BOUNDED_MANIFEST).is_file()


def cmd_program_repository(args) -> int:
    from ..repository import ProgramOptions, write_program_repository

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


def cmd_repository(args) -> int:
    from ..repository import RepositoryOptions, write_repository

    if _is_program(args.artifact):
        return cmd_program_repository(args)

    opts = RepositoryOptions(max_sequence_idle_microseconds=args.max_sequence_idle_us,
                             donate_kv_pools=not args.no_donate,
                             cohort_wait_microseconds=args.cohort_wait_us,
                             cohort_wait_steps=args.cohort_wait_steps,
                             prefill_wait_microseconds=args.prefill_wait_us,
                             mixed_chunk_tokens=args.mixed_chunk_tokens,
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
                             expert_load_metrics=args.expert_load_metrics,
                             reply_threads=args.reply_threads,
                             generation_loop=args.generation_loop,
                             host_kv_bytes=args.host_kv_bytes,
                             runtime=args.runtime, pjrt_plugin=args.pjrt_plugin,
                             lora=tuple(args.lora), lora_host_bytes=args.lora_host_bytes,
                             lora_updates_root=args.lora_updates_root,
                             preempt_wait_microseconds=args.preempt_wait_us,
                             background_compile=not args.compile_all_first)
    model_dir = write_repository(args.artifact, args.repo, args.name, opts)
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/"
          + ("" if args.no_generate_model else f", and {model_dir}_generate (generation on the "
                                               f"server, streamed over gRPC)"))
    return 0


def cmd_serve(args) -> int:
    from ..triton.supervisor import serve

    return serve(args)


def cmd_check_stubs(args) -> int:
    from ..triton.supervisor import check_stubs

    return check_stubs(args)


def cmd_openai(args) -> int:
    from ..frontends.http_doors import default_allowed_hosts, is_loopback
    from ..frontends.openai_server import ServedModel, ServerOptions, serve

    # The flag wins over the environment; an empty key is no key.
    api_key = (args.api_key if args.api_key is not None
               else os.environ.get("TLALOC_API_KEY")) or None
    if api_key is None and not is_loopback(args.host):
        print(f"tlaloc openai: warning: serving {args.host}, not a loopback address, with no "
              f"API key: whoever reaches it can generate (set TLALOC_API_KEY or --api-key)",
              file=sys.stderr)
    admin_key = (args.admin_key if args.admin_key is not None
                 else os.environ.get("TLALOC_ADMIN_KEY")) or None
    options = ServerOptions(
        api_key=api_key, admin_key=admin_key, max_body_bytes=args.max_body_bytes,
        max_concurrent=args.max_concurrent,
        cors_origins=tuple(args.cors_origin or ()),
        allowed_hosts=(tuple(args.allowed_host) if args.allowed_host
                       else default_allowed_hosts(args.host)),
        max_prompt_chars=args.max_prompt_chars, header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s,
        max_header_bytes=args.max_header_bytes)
    models = {}  # each model, and each LoRA adapter its sequence model serves as a model
    for name in args.model:
        models.update(ServedModel.discover_with_adapters(
            args.url, name, tokenizer_dir=args.tokenizer, tool_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser))
    serve(args.url, models, args.host, args.port, options=options)
    return 0


def _structured_output(args) -> dict | None:
    """The structured_output a --json-schema, --json-object, --regex, --choice or --grammar
    flag asks for (None: free text); FileNotFoundError, or ValueError for a schema file that is
    not JSON."""
    if args.json_schema:
        try:
            return {"json_schema": json.loads(Path(args.json_schema).read_text())}
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON: {e}") from None
    if args.grammar:
        return {"grammar": Path(args.grammar).read_text()}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return None


def _generate_structured(args, client, prompt_ids: list[int], constraint: dict) -> int:
    """A greedy generation under `constraint` by NAME_generate (the server's loop enforces
    it), reported as the client's own loop is."""
    t0 = time.perf_counter()
    sampling = {"max_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos}
    if args.speculate:
        sampling["speculative"] = {"method": "prompt_lookup", "num_draft_tokens": args.speculate}
    got = client.generate(prompt_ids, sampling, structured_output=constraint)
    total_ms = (time.perf_counter() - t0) * 1e3
    first_ms = got.first_token_ms or total_ms
    per_token = (total_ms - first_ms) / max(1, len(got.token_ids) - 1)
    report(args, list(prompt_ids), got.token_ids, got.text, got.finish_reason, first_ms,
           per_token, f"{args.protocol}, {args.model}_generate: ", {})
    return 0


def cmd_generate(args) -> int:
    from ..frontends.client import InferError, TlalocClient
    from ..frontends.tokenizer import ArtifactTokenizer

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
            constraint = _structured_output(args)
            if constraint is not None:
                return _generate_structured(args, client, prompt_ids, constraint)
            gen = client.generate_greedy(prompt_ids, args.max_new_tokens, stop,
                                         speculate=args.speculate)
        except InferError as e:
            print(f"tlaloc generate: the server refused: {e}", file=sys.stderr)
            return 1
    text = tok.decode(gen.generated_ids) if tok is not None else None
    report(args, gen.prompt_ids, gen.generated_ids, text, gen.finish_reason, gen.prefill_ms,
            gen.ms_per_token, f"{args.protocol}: ", {})
    return 0

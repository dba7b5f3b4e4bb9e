"""What each device holds when a model is split over N devices: SmolLM2-135M exported for
1 and 3 devices (its 9 heads and 3 KV heads divide over 3; over 2 and 4 the export refuses by
name), on 3 also with the embedding and head copied whole (--replicate-vocab), loaded by the
runtime on virtual CPU devices, weights and KV pools read from the device buffers. Nothing is
compiled (the bytes do not depend on it).

    .venv/bin/python scripts/device_memory.py [--work artifacts/device-memory]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triton_tlaloc.runtime.pjrt import cpu_devices

cpu_devices(4)  # before JAX starts

from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.export.options import ExportError  # noqa: E402
from triton_tlaloc.runtime.core import Runtime  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPTS = dict(batch_ladder=(1, 4), context_ladder=(512, 2048), verify_tokens=())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "device-memory")
    args = ap.parse_args()
    gguf = smollm2_gguf_path()
    rows = []
    for n, copied in ((1, False), (2, False), (3, False), (3, True), (4, False)):
        label = f"{n}, the vocabulary copied" if copied else str(n)
        try:
            art = export_artifact(gguf, args.work / f"smollm2-tp{n}{'-copied' if copied else ''}",
                                  ExportOptions(**OPTS, tensor_parallel=n,
                                                replicate_vocab=copied))
        except ExportError as e:
            rows.append((label, None, str(e).split(": ", 2)[-1]))
            continue
        rows.append((label, Runtime(art, entries=[]), ""))
    one = rows[0][1]
    print(f"SmolLM2-135M f32, {one.artifact.model.num_blocks} pages of "
          f"{one.artifact.model.block_size} tokens (batch 4 at context 2048)\n")
    print("| devices | weights a device (MiB) | KV pools a device (MiB) | a device in all | "
          "of one device |")
    print("|---:|---:|---:|---:|---:|")
    whole = one.weight_bytes + one.kv_pool_bytes
    for n, rt, refused in rows:
        if rt is None:
            print(f"| {n} | refused: {refused} | | | |")
            continue
        w, kv = max(rt.weight_device_bytes), max(rt.kv_device_bytes)
        print(f"| {n} | {w / 2**20:.1f} | {kv / 2**20:.1f} | {(w + kv) / 2**20:.1f} | "
              f"{(w + kv) / whole:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The exporter: a checkpoint in, a Tlaloc serving artifact out (docs/architecture.md#export).

    config.py            a checkpoint's config as a DecoderConfig; the families
    checkpoint.py        Hugging Face and GGUF checkpoints read into a DecoderConfig and tensors
    decoder.py           weight slots, pools, entry signatures; make_entry_fn strings the layers
    layers.py            the decoder graph's parts in JAX: embedding, attention, linear layer, MLP, head
    attention.py         paged attention (one pass and blockwise) and its masks
    linear_attention.py  Gated DeltaNet's conv and delta rule (the qwen3_5 hybrid family)
    quant.py             per-output-channel int8 / fp8 codes and scales, int4 codes per group
    gguf_packed.py       GGUF's quantized blocks taken apart into one packed layout
    packing.py           --weight-quant gguf|int4: each packed slot's type, its packed arrays
    hf_packed.py         AWQ and GPTQ linears taken apart into the packed layout
    packed_linear.py     a packed weight widened inside the graph, fused into the product
    options.py           ExportOptions and their checks
    writer.py            weight streaming, lowering, the manifest, write-then-rename

The names below are the exporter's public interface; `bounded` and `program` export JAX
functions that are not language models (triton_tlaloc.programs).
"""

from __future__ import annotations

from pathlib import Path

from .options import ExportError, ExportOptions
from .writer import export_artifact

__all__ = ["ExportError", "ExportOptions", "export_artifact", "bounded", "program"]


def bounded(fn, inputs, bounds, out, **kwargs) -> Path:
    """A JAX function with bounded axes as a tlaloc-bounded-v1 artifact
    (programs.bounded.export_bounded)."""
    from ..programs.bounded import export_bounded

    return export_bounded(fn, inputs, bounds, out, **kwargs)


def program(fn, inputs, out, donate=()) -> Path:
    """A JAX function as a generic StableHLO program for `tlaloc repository`
    (programs.generic.export_program)."""
    from ..programs.generic import export_program

    return export_program(fn, inputs, out, donate)

"""--max-lora-rank: the adapter pools an export's entries read (lora/layout.py), or a model
they cannot serve refused by name before anything is written."""

from __future__ import annotations

from ..lora.layout import LoraLayout, lora_layout
from .config import DecoderConfig
from .options import ExportError, ExportOptions
from .tensor_parallel import TensorParallelError, head_copies


def adapter_layout(cfg: DecoderConfig, opts: ExportOptions) -> LoraLayout | None:
    """The pools of `opts.max_lora_rank` and `opts.lora_slots` (plus slot 0, no adapter) for
    every layer's q|k|v, o, gate|up and down, split over --tensor-parallel's devices as the
    base weights are; None without --max-lora-rank."""
    if not opts.max_lora_rank:
        return None
    flag = f"--max-lora-rank {opts.max_lora_rank}"
    missing = ("linear-attention layers" if cfg.linear is not None else
               "mixtures of experts" if cfg.moe is not None else
               "gated attention outputs" if cfg.attn_output_gate else None)
    if missing:
        raise ExportError(f"{flag}: adapters on {missing} ({cfg.family}) are not served; "
                          f"adapters are served on llama, qwen3, mistral and gemma3_text")
    n = opts.tensor_parallel
    try:  # the KV heads' copies, as the base weights' (tensor_parallel.plan)
        kv_copies = head_copies(cfg.num_kv_heads, n, "KV heads", cfg.model_name)
    except TensorParallelError:
        kv_copies = 1  # (the heads are refused by name with the weights)
    d = cfg.head_size
    return lora_layout(opts.max_lora_rank, opts.lora_slots + 1, cfg.num_layers,
                       cfg.hidden_size, cfg.num_heads * d, cfg.num_kv_heads * d,
                       cfg.num_heads * d, cfg.intermediate_size, n, kv_copies)


__all__ = ["adapter_layout"]

"""Whether an artifact can run under a vLLM configuration, and what a request may ask of it:
each refusal names what does not fit and what would (no vLLM imported here)."""

from __future__ import annotations

from ..artifact.manifest import SCHEMA_V2, Artifact


def artifact_refusals(art: Artifact, *, block_size: int | None, max_model_len: int | None,
                      tensor_parallel: int = 1, pipeline_parallel: int = 1, lora: bool = False,
                      speculative: bool = False) -> list[str]:
    """Why `art` cannot run with these vLLM settings (empty: it can). `block_size` is the one
    the user asked for (None: the artifact's is taken)."""
    out = []
    m = art.model
    if art.schema != SCHEMA_V2:
        kind = ("sliding-window rings" if art.windowed is not None
                else "linear-attention state slots" if art.linear_state is not None
                else f"schema {art.schema}")
        out.append(f"{art.path}: its {kind} ({art.schema}) have no vLLM block table; only "
                   f"full-history pages ({SCHEMA_V2}) run under vLLM")
    if block_size is not None and block_size != m.block_size:
        out.append(f"block size {block_size}: the artifact's pages hold {m.block_size} tokens "
                   f"(--block-size {m.block_size})")
    if max_model_len is not None and max_model_len not in art.context_ladder:
        out.append(f"max model length {max_model_len} is not on the artifact's context ladder "
                   f"{list(art.context_ladder)} (--max-model-len one of them)")
    if art.devices != 1 or tensor_parallel != 1 or pipeline_parallel != 1:
        out.append(f"tensor parallel {tensor_parallel}, pipeline parallel {pipeline_parallel} "
                   f"for an artifact of {art.devices} device(s): the worker runs one-device "
                   f"artifacts on one device")
    if lora:
        out.append("LoRA adapters: not run under vLLM (tlaloc serve runs them)")
    if speculative:
        out.append("speculative decoding: not run under vLLM (tlaloc serve runs it)")
    return out


def request_refusals(params, verify_tokens: tuple[int, ...] = ()) -> list[str]:
    """What a request's SamplingParams ask that the worker (vLLM's Sampler and logits
    processors over each row's last logits, under its grammar's mask) cannot give: the
    prompt's own logprobs from an artifact without verify entries (only those give the logits
    after every position)."""
    out = []
    if getattr(params, "prompt_logprobs", None) is not None and not verify_tokens:
        out.append("prompt_logprobs: the artifact has no verify entries, which give the logits "
                   "after every prompt position (export it with --verify-tokens)")
    return out

"""TlalocPlatform: vLLM's CPU platform (its defaults, device and processes) whose worker is the
tlaloc worker, its block size and block count the artifact's; an artifact or a request that does
not fit is refused by name (fit.py)."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError
from vllm.platforms.cpu import CpuPlatform

from ..artifact.loading import load_artifact
from .fit import artifact_refusals, request_refusals

WORKER = "triton_tlaloc.vllm_plugin.worker.TlalocWorker"


class TlalocPlatform(CpuPlatform):
    device_name = "tlaloc"  # (device_type stays "cpu": vLLM's CPU paths and defaults)
    verify_tokens: tuple[int, ...] = ()  # the artifact's, for the requests' refusals

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model, cache = vllm_config.model_config, vllm_config.cache_config
        parallel = vllm_config.parallel_config
        if model is not None:
            art = load_artifact(model.model)  # an ArtifactError names what is wrong with it
            refusals = artifact_refusals(
                art, block_size=cache.block_size if cache.user_specified_block_size else None,
                max_model_len=model.max_model_len,
                tensor_parallel=parallel.tensor_parallel_size,
                pipeline_parallel=parallel.pipeline_parallel_size,
                lora=vllm_config.lora_config is not None,
                speculative=vllm_config.speculative_config is not None)
            if refusals:
                raise ValueError("tlaloc: " + "; ".join(refusals))
            cls.verify_tokens = art.verify_tokens
            # vLLM's blocks are the artifact's pages: block 0 is kept back by both
            cache.block_size = art.model.block_size
            cache.user_specified_block_size = True  # (else the CPU platform takes 128)
            cache.num_gpu_blocks_override = art.model.num_blocks
            if model.tokenizer == model.model and art.tokenizer_dir is not None:
                model.tokenizer = str(art.tokenizer_dir)
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER
        super().check_and_update_config(vllm_config)
        # The worker runs in the engine's process (the CPU platform would start one of its
        # own to bind torch's threads; no torch kernel runs here).
        if parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        refusals = request_refusals(params, cls.verify_tokens)
        if refusals:  # (a ValidationError: a 400 from the server, not a 500)
            raise VLLMValidationError("tlaloc: " + "; ".join(refusals))

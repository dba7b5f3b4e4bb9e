"""TlalocWorker: vLLM's worker with no torch model. It loads the artifact on the project's
runtime (the C API runtime by default: vLLM's environment holds no JAX; TLALOC_VLLM_RUNTIME=jax
for JAX's), reports the artifact's pools as one full-attention KV cache, and runs each
SchedulerOutput through runner.ArtifactRunner, drawing each step's tokens with vLLM's own
Sampler (sampling.RequestSampler)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from ..runtime.core import Runtime
from .runner import ArtifactRunner, mask_rows
from .sampling import RequestSampler

log = logging.getLogger("triton_tlaloc.vllm")
RUNTIME_ENV = "TLALOC_VLLM_RUNTIME"
POOLS = "tlaloc.pools"  # the one KV cache "layer" standing for all of the artifact's pools


class TlalocWorker(WorkerBase):
    def init_device(self) -> None:
        self.device = torch.device("cpu")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        runtime = os.environ.get(RUNTIME_ENV, "capi")
        t0 = time.perf_counter()
        # The first entries now, the rest on compile threads; a call waits for its own.
        self.rt = Runtime(self.model_config.model, background=True,
                          plugin="" if runtime == "capi" else None)
        self.runner = ArtifactRunner(self.rt)
        self.step_logits: tuple[list[str], dict] = ([], {})  # execute_model to sample_tokens
        self.prompt_logprobs: dict = {}  # the step's finished prompts' logprobs, by request
        self.sampler = RequestSampler(self.vllm_config, self.rt.artifact.model.vocab)
        log.info("tlaloc: artifact %s on the %s runtime, %d of %d entries compiled in %.1f s",
                 self.model_config.model, runtime, len(self.rt.executables),
                 self.rt.entries_total, time.perf_counter() - t0)

    def get_kv_cache_spec(self):
        m = self.rt.artifact.model
        # Only the block size and a page's bytes matter to vLLM: the count is the artifact's
        # (num_gpu_blocks_override, set by the platform)
        return {POOLS: FullAttentionSpec(block_size=m.block_size, num_kv_heads=m.kv_heads,
                                         head_size=m.head_size, dtype=torch.float32)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return [layout.name for layout in get_supported_kv_cache_layouts([])]

    def determine_available_memory(self) -> int:
        spec = self.get_kv_cache_spec()[POOLS]
        return self.rt.artifact.model.num_blocks * spec.page_size_bytes

    def initialize_from_config(self, kv_cache_config) -> None:
        blocks = self.rt.artifact.model.num_blocks
        assert kv_cache_config.num_blocks == blocks, (kv_cache_config.num_blocks, blocks)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=self.rt.compile_stats.seconds, encoder=0.0)

    def get_supported_tasks(self):
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def reset_encoder_cache(self) -> None:
        pass

    def get_model_inspection(self) -> str:
        art = self.rt.artifact
        return (f"tlaloc artifact {art.path} ({art.model.family}, {len(art.entries)} entries, "
                f"pages of {art.model.block_size})")

    def get_runner_calls(self) -> int:
        """Entry calls run so far (tests)."""
        return self.runner.calls

    def execute_model(self, scheduler_output) -> None:
        """Run the step's entry calls and keep the logits of the rows that sample; vLLM then
        asks for the tokens (`sample_tokens`) with the grammar bitmask of the step's
        structured-output requests."""
        so = scheduler_output
        assert so.kv_cache_block_copies is None, "partial-block copies need several KV groups"
        runner = self.runner
        for rid in so.finished_req_ids:
            runner.finish(rid)
            self.sampler.finish(rid)
        for new in so.scheduled_new_reqs:
            self.sampler.add(new.req_id, new.sampling_params)
            runner.add(new.req_id, new.prompt_token_ids, new.block_ids[0],
                       new.num_computed_tokens,
                       every_position=self.sampler.wants_prompt_logprobs(new.req_id))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            pages = cached.new_block_ids[i]
            runner.update(rid, cached.num_computed_tokens[i],
                          None if pages is None else pages[0],
                          resumed=rid in cached.resumed_req_ids,
                          tokens=cached.all_token_ids.get(rid))
        req_ids = list(so.num_scheduled_tokens)
        starts = {rid: runner.requests[rid].computed for rid in req_ids}
        # (a step of nothing runs nothing, and leaves no chunk of a finished request behind)
        self.step_logits = (req_ids, runner.run(dict(so.num_scheduled_tokens)))
        self.prompt_logprobs = {}
        for rid, chunk in runner.chunk_logits.items():  # (only requests asking for them)
            st = runner.requests[rid]
            if starts[rid] < st.prompt_len:
                scored = self.sampler.prompt_logprobs(rid, st.prompt, starts[rid], chunk)
                if scored is not None:
                    self.prompt_logprobs[rid] = scored
        return None

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """The step's tokens: each sampling row's logits under its grammar's mask (a
        structured-output request), drawn by vLLM's Sampler."""
        req_ids, logits = self.step_logits
        self.step_logits = ([], {})
        runner = self.runner
        rows = [rid for rid in req_ids if rid in logits]  # prompt chunks draw nothing
        drawn, logprobs = {}, None
        if rows:
            states = [runner.requests[rid] for rid in rows]
            table = np.stack([logits[rid] for rid in rows]).astype(np.float32)
            if grammar_output is not None:
                mask_rows(table, rows, grammar_output.structured_output_request_ids,
                          grammar_output.grammar_bitmask)
            tokens, logprobs = self.sampler.sample(rows, table, [st.prompt for st in states],
                                                   [st.output for st in states])
            for rid, token in zip(rows, tokens):
                runner.append(rid, token)
                drawn[rid] = token
        if logprobs is not None:  # a row for each request that drew a token: where each starts
            starts = np.cumsum([0] + [rid in drawn for rid in req_ids]).tolist()
            logprobs = logprobs._replace(cu_num_generated_tokens=starts)
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[[drawn[r]] if r in drawn else []
                                                    for r in req_ids],
                                 logprobs=logprobs, prompt_logprobs_dict=self.prompt_logprobs)

"""A step's tokens drawn by vLLM's own Sampler from the artifact's logits, as vLLM's GPU runner
gives them: temperature, top-p, top-k, a seed per request, presence, frequency and repetition
penalties, allowed token ids, bad words and logprobs through its input batch's sampling
metadata, built here for the rows that sample this step; min-p, logit bias, min tokens (and any
logits processor the server was started with) through vLLM's logits processors, made for the
step and told its rows; after a structured-output request's grammar mask (the worker's)."""

from __future__ import annotations

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.outputs import LogprobsLists, LogprobsTensors
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors, build_logitsprocs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler


class RequestSampler:
    """Each request's SamplingParams and seeded generator, kept from its first step to its
    end (a generator goes on where the request's last step left it, as in vLLM's runner)."""

    def __init__(self, vllm_config, vocab: int):
        self.vllm_config = vllm_config
        self.vocab = vocab
        self.sampler = Sampler(logprobs_mode=vllm_config.model_config.logprobs_mode)
        # vLLM's logits processor classes, its own and any the server was started with: found
        # once (finding them reads every installed package's entry points, 15 ms a step)
        self.processor_classes = [type(p) for p in build_logitsprocs(
            vllm_config, torch.device("cpu"), False, False).all]
        self.params: dict[str, object] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_scores: dict[str, LogprobsTensors] = {}  # filled chunk by chunk

    def add(self, req_id: str, params) -> None:
        self.params[req_id] = params
        if params.seed is not None:
            self.generators[req_id] = torch.Generator().manual_seed(params.seed)

    def finish(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.generators.pop(req_id, None)
        self.prompt_scores.pop(req_id, None)

    def wants_prompt_logprobs(self, req_id: str) -> bool:
        return self.params[req_id].prompt_logprobs is not None

    def prompt_logprobs(self, req_id: str, prompt: list[int], start: int,
                        chunk_logits: np.ndarray) -> LogprobsTensors | None:
        """A prompt chunk's logprobs, as vLLM's GPU runner makes them: the logits after each
        position from `start` score the prompt's next token (its logprob, rank and the top
        asked for), kept until the prompt's last token is scored; then the whole prompt's (one
        row a token after the first), else None."""
        asked = self.params[req_id].prompt_logprobs
        asked = self.vocab if asked == -1 else asked
        done = self.prompt_scores.get(req_id)
        if done is None:
            done = self.prompt_scores[req_id] = LogprobsTensors.empty_cpu(len(prompt) - 1,
                                                                          asked + 1)
        left = len(prompt) - (start + 1)  # prompt tokens after `start` still to score
        n = min(len(chunk_logits), left)
        if n > 0:
            logits = torch.from_numpy(np.ascontiguousarray(chunk_logits[:n], dtype=np.float32))
            scores = (logits if self.sampler.logprobs_mode in ("raw_logits", "processed_logits")
                      else self.sampler.compute_logprobs(logits))
            ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(
                scores, asked, torch.tensor(prompt[start + 1:start + 1 + n]))
            done.logprob_token_ids[start:start + n] = ids
            done.logprobs[start:start + n] = logprobs
            done.selected_token_ranks[start:start + n] = ranks
        if len(chunk_logits) <= left:  # (scored to the end: returned with the first token)
            return None
        return self.prompt_scores.pop(req_id)

    def sample(self, req_ids: list[str], logits: np.ndarray, prompts: list[list[int]],
               outputs: list[list[int]]) -> tuple[list[int], LogprobsLists | None]:
        """One token for each of `req_ids` from its row of `logits` (its prompt and the tokens
        generated so far feed the penalties), and, when any of them asks, their logprobs (a
        row each, in `req_ids` order)."""
        assert logits.shape[0] == len(req_ids), (logits.shape, len(req_ids))
        meta = self.metadata(req_ids, prompts, outputs)
        out = self.sampler(torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32)),
                           meta)
        tokens = out.sampled_token_ids.reshape(-1).tolist()
        lists = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        return tokens, lists

    def metadata(self, req_ids: list[str], prompts: list[list[int]],
                 outputs: list[list[int]]) -> SamplingMetadata:
        """vLLM's sampling metadata for these rows, as its input batch makes it."""
        params = [self.params[r] for r in req_ids]
        n = len(params)
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        top_k = [p.top_k if 0 < p.top_k < self.vocab else self.vocab for p in params]
        asked = [self.vocab if p.logprobs == -1 else p.logprobs for p in params
                 if p.logprobs is not None]
        penalties = [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                     for p in params]
        no_penalties = all(x == (0.0, 0.0, 1.0) for x in penalties)
        prompt_ids = None
        if not no_penalties:  # padded with the vocabulary size, as vLLM pads them
            width = max(len(p) for p in prompts)
            prompt_ids = torch.full((n, width), self.vocab, dtype=torch.int64)
            for i, p in enumerate(prompts):
                prompt_ids[i, :len(p)] = torch.tensor(p, dtype=torch.int64)
        allowed = None
        if any(p.allowed_token_ids for p in params):  # True: not allowed (vLLM's mask)
            allowed = torch.zeros((n, self.vocab), dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    allowed[i] = True
                    allowed[i, p.allowed_token_ids] = False
        outputs = [list(o) for o in outputs]
        return SamplingMetadata(
            temperature=torch.tensor([0.0 if g else p.temperature
                                      for g, p in zip(greedy, params)], dtype=torch.float32),
            all_greedy=all(greedy), all_random=not any(greedy),
            top_p=(None if all(p.top_p >= 1.0 for p in params)
                   else torch.tensor([p.top_p for p in params], dtype=torch.float32)),
            top_k=(None if all(k == self.vocab for k in top_k)
                   else torch.tensor(top_k, dtype=torch.int32)),
            generators={i: self.generators[r] for i, r in enumerate(req_ids)
                        if r in self.generators},
            max_num_logprobs=max(asked) if asked else None,
            no_penalties=no_penalties, prompt_token_ids=prompt_ids,
            presence_penalties=torch.tensor([x[0] for x in penalties], dtype=torch.float32),
            frequency_penalties=torch.tensor([x[1] for x in penalties], dtype=torch.float32),
            repetition_penalties=torch.tensor([x[2] for x in penalties], dtype=torch.float32),
            output_token_ids=outputs, allowed_token_ids_mask=allowed,
            bad_words_token_ids={i: p.bad_words_token_ids for i, p in enumerate(params)
                                 if p.bad_words_token_ids},
            logitsprocs=self.logits_processors(params, prompts, outputs))

    def logits_processors(self, params, prompts, outputs) -> LogitsProcessors:
        """vLLM's logits processors for this step's rows: made anew and told the rows as
        added (they keep per-row state for vLLM's persistent batch, which the worker does not
        keep; a fresh set a step holds what the rows' params and tokens say now)."""
        procs = LogitsProcessors(cls(self.vllm_config, torch.device("cpu"), False)
                                 for cls in self.processor_classes)
        update = BatchUpdate(batch_size=len(params), removed=[], moved=[],
                             added=[(i, p, prompt, out) for i, (p, prompt, out)
                                    in enumerate(zip(params, prompts, outputs))])
        for proc in procs.all:
            proc.update_state(update)
        return procs

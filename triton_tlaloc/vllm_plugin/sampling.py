"""A step's tokens drawn by vLLM's own Sampler from the artifact's logits: temperature, top-p,
top-k, a seed per request, presence, frequency and repetition penalties, and logprobs, as
vLLM's GPU runner gives them (its input batch's sampling metadata, built here for the rows that
sample this step). What vLLM applies through its batch-tracking logits processors (min-p,
logit bias, min tokens) or elsewhere is refused by name before a request runs (fit.py)."""

from __future__ import annotations

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler


class RequestSampler:
    """Each request's SamplingParams and seeded generator, kept from its first step to its
    end (a generator goes on where the request's last step left it, as in vLLM's runner)."""

    def __init__(self, vocab: int, logprobs_mode: str = "raw_logprobs"):
        self.vocab = vocab
        self.sampler = Sampler(logprobs_mode=logprobs_mode)
        self.params: dict[str, object] = {}
        self.generators: dict[str, torch.Generator] = {}

    def add(self, req_id: str, params) -> None:
        self.params[req_id] = params
        if params.seed is not None:
            self.generators[req_id] = torch.Generator().manual_seed(params.seed)

    def finish(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.generators.pop(req_id, None)

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
            output_token_ids=[list(o) for o in outputs] if not no_penalties else [],
            allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors())

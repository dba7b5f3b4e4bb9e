"""Sampling by the book, the oracle of the sampler's draws (tests/unit/test_sampling.py) and
its baseline in scripts/sampling_bench.py."""

from __future__ import annotations

import numpy as np

from triton_tlaloc.generation.sampling import SamplingParams


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Sampling by the book, over the whole vocabulary (the oracle): temperature, top-k (ties
    kept), top-p over a stable sort of every probability; what `reference_choice` draws from."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        z = np.where(z >= np.partition(z, -params.top_k)[-params.top_k], z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = stable_nucleus(probs, params.top_p)
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return probs


def stable_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p by the book: the positions (ascending) of the shortest head of a stable sort of
    every probability whose sum reaches top_p."""
    order = np.argsort(-probs, kind="stable")
    return np.sort(order[:int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1])


def reference_choice(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A draw from `reference_probs` with Generator.choice."""
    return int(rng.choice(probs.size, p=probs))


def logit_rows(n: int, vocab: int = 49_152, seed: int = 0) -> list[np.ndarray]:
    """Rows of logits over a vocabulary of SmolLM2's size: peaked ones (a language model's
    shape: a few likely tokens) and flat ones (a top-p nucleus of thousands) in turn, each with
    a run of tied logits (a top-k or top-p boundary may fall inside it)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        scale = 3.0 if i % 2 else 0.5
        row = (-np.log1p(rng.permutation(vocab)) * scale
               + rng.standard_normal(vocab) * 0.5).astype(np.float32)
        ties = rng.choice(vocab, 64, replace=False)
        row[ties] = row[ties[0]]
        rows.append(row)
    return rows

"""Drafters for speculative decoding: cheap guesses at a sequence's next tokens, which the
sequence model checks in one verify call (docs/design.md#speculative-decoding). Pure numpy.

Prompt lookup (vLLM's n-gram speculation): much of what people generate repeats its input
(editing code, quoting a passage, extraction), so the tokens that followed the latest earlier
occurrence of the text's last few tokens are a guess that costs nothing to make.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


def prompt_lookup(history: list[int], k: int, max_ngram: int = DEFAULT_MAX_NGRAM,
                  min_ngram: int = DEFAULT_MIN_NGRAM) -> list[int]:
    """Up to `k` drafts: the tokens that followed the latest earlier occurrence of the last n
    tokens of `history` (the prompt and what was generated so far), trying the longest n from
    `max_ngram` down to `min_ngram`; [] when none of them occurs before."""
    if k < 1 or len(history) < 2:
        return []
    ids = np.asarray(history, dtype=np.int64)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        # Windows that start early enough to be followed by at least one token.
        windows = sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most recent context
            return ids[start:start + k].tolist()
    return []


class NgramIndex:
    """`prompt_lookup` kept up to date as a generation grows: for each n from `min_ngram` to
    `max_ngram`, where the latest occurrence of each n tokens (followed by at least one token)
    ends. Adding a token costs `max_ngram` dictionary writes and a lookup as many reads, where
    `prompt_lookup` scans the whole history: a generation looks up once a step, on the batching
    thread, where its cost is paid by every sequence in the round."""

    def __init__(self, history: list[int] = (), max_ngram: int = DEFAULT_MAX_NGRAM,
                 min_ngram: int = DEFAULT_MIN_NGRAM):
        assert 1 <= min_ngram <= max_ngram, (min_ngram, max_ngram)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.history: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n tokens -> where what followed starts
        self.extend(history)

    def extend(self, tokens) -> None:
        h = self.history
        for t in tokens:
            # The n tokens before t are now followed by one: t's position is where a draft
            # after them would start.
            at = len(h)
            for n in range(self.min_ngram, min(self.max_ngram, at) + 1):
                self.ends[tuple(h[at - n:at])] = at
            h.append(int(t))

    def lookup(self, k: int) -> list[int]:
        """Up to `k` drafts (what `prompt_lookup(history, k, ...)` returns)."""
        h = self.history
        if k < 1 or len(h) < 2:
            return []
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            start = self.ends.get(tuple(h[len(h) - n:]))
            if start is not None:
                return h[start:start + k]
        return []


__all__ = ["DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM", "NgramIndex", "prompt_lookup"]

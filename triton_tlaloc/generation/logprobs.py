"""Log-probabilities of the chosen tokens (docs/serving.md#log-probabilities): the model's
log-softmax over the raw logits of the row that chose them, before temperature, penalties,
logit_bias or a grammar's mask (vLLM's default, `raw_logprobs`), so they say what the model
thinks whatever the request did to the choice. And the prompt's own (`PromptScoring`): a prefill
call gives only its last position's logits, so a generation asking for them feeds its prompt in
chunks of the largest verify entry's tokens (a verify call gives every position's logits), one
chunk a batcher round, or one token a decode step without verify entries; a prompt longer than
the model's bound is refused by name. Pure numpy."""

from __future__ import annotations

import numpy as np

MAX_TOP_LOGPROBS = 20  # as OpenAI allows


def logprob_entry(logits: np.ndarray, token: int, top: int) -> list:
    """[the token's log-probability, [[id, log-probability] of the `top` most likely,
    most likely first]] from one row's raw logits."""
    z = np.asarray(logits, np.float32).reshape(-1)
    peak = z.max()
    lse = peak + np.log(np.sum(np.exp(z - peak), dtype=np.float64))
    chosen = float(z[token] - lse)
    if not top:
        return [chosen, []]
    ids = np.argpartition(-z, top - 1)[:top] if top < z.size else np.arange(z.size)
    ids = ids[np.lexsort((ids, -z[ids]))]  # most likely first, ties to the lower id
    return [chosen, [[int(i), float(z[i] - lse)] for i in ids]]


def ranked_entry(logits: np.ndarray, token: int, top: int) -> list:
    """logprob_entry with the token's rank appended: 1 + how many tokens are more likely."""
    z = np.asarray(logits, np.float32).reshape(-1)
    return logprob_entry(z, token, top) + [1 + int(np.count_nonzero(z > z[token]))]


class PromptScoring:
    """A generation's prompt fed so that each position's logits are seen: its START feeds the
    first token, then each step feeds the next tokens, several at once as a verify call's
    forced tokens when the model verifies (`per_call` tokens at most: the largest verify
    entry's), the last alone as a decode step, whose logits choose the first generated token.
    Each step is one request, the next sent when its reply comes: one chunk a batcher round.
    `entries[i]` is prompt token i's logprob_entry given the tokens before it, with its rank
    among all (1: the most likely) appended (None for the first, which follows nothing).
    A prompt of more than `most_tokens` is refused (SamplingError), so that no request's
    scoring runs for minutes (`tlaloc openai` waits 120 s for a first response)."""

    def __init__(self, prompt: list[int], top: int, per_call: int,
                 most_tokens: int | None = None):
        assert prompt and per_call >= 1
        if most_tokens is not None and len(prompt) > most_tokens:
            from .sampling import SamplingError  # (sampling.py imports this module)
            raise SamplingError(
                f"sampling parameter prompt_logprobs: a prompt of {len(prompt)} tokens is "
                f"longer than this model scores ({most_tokens} at most, its model parameter "
                f"prompt_logprobs_max_tokens): each prompt token's log-probabilities take a "
                f"verify call per {per_call} tokens")
        self.prompt, self.top, self.per_call = prompt, top, per_call
        self.fed = 0  # prompt tokens fed and answered
        self.entries: list = [None]

    @property
    def done(self) -> bool:
        """Whether the whole prompt is fed: the last reply's logits are the answer's."""
        return self.fed == len(self.prompt)

    def next_feed(self) -> list[int]:
        """The tokens the next step feeds: up to `per_call`, never the last prompt token with
        others (its logits are the generation's, and come from a decode step)."""
        assert 0 < self.fed < len(self.prompt)
        end = min(self.fed + self.per_call, len(self.prompt) - 1)
        return self.prompt[self.fed:max(end, self.fed + 1)]

    def took_logits(self, logits: np.ndarray) -> None:
        """A prefill or decode step fed one more prompt token; `logits` follow it."""
        self.fed += 1
        if not self.done:
            self.entries.append(ranked_entry(logits, self.prompt[self.fed], self.top))

    def accept(self, position_logits: np.ndarray, forced: list[int]) -> tuple[int, int]:
        """A verify step's acceptor: the step fed prompt token `fed` and `forced` after it
        (fewer than were sent when the batcher ran the row as a decode step), and
        `position_logits` follow each; all stand, and the next prompt token follows them."""
        assert forced == self.prompt[self.fed + 1:self.fed + 1 + len(forced)]
        for row in position_logits[:len(forced) + 1]:
            self.fed += 1
            self.entries.append(ranked_entry(row, self.prompt[self.fed], self.top))
        return len(forced), self.prompt[self.fed]


__all__ = ["MAX_TOP_LOGPROBS", "PromptScoring", "logprob_entry", "ranked_entry"]

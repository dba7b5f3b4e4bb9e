"""Speculative decoding's half of the engine (docs/design.md#speculative-decoding): a verify
call feeds a sequence its next token and a few drafts in one call on a verify entry, which
gives the argmax after every position; the drafts the model agrees with are kept, and the
sequence is cut back to them. Greedy ids are exactly those of decoding one token a call.

`Verifier` is the engine's collaborator for these calls (`Engine.verifier`): it chooses and
runs entries through its engine (`entry_for`, `compiled_rows`, `step_inputs`, `ring_room`).
Pure Python and numpy: no JAX, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..codes import RequestError
from ..kv.sequence import Sequence

if TYPE_CHECKING:
    from .core import Engine

__all__ = ["Acceptor", "Verified", "Verifier", "accepted_drafts"]

# Sampled speculation's rule for one row: given the logits after the token before the drafts and
# after each draft ([drafts + 1, vocab]) and the drafts, how many drafts stand and the token that
# follows them.
Acceptor = Callable[[np.ndarray, list[int]], tuple[int, int]]


@dataclass
class Verified:
    """One row of a verify call: the drafts it accepted, then the model's own next token (the
    argmax after the last accepted position), and with logits asked for, the logits there."""

    accepted: list[int]
    logits: np.ndarray | None = None


def accepted_drafts(drafts: list[int], predicted) -> int:
    """How many leading drafts the model agrees with: draft i stands when it is the argmax
    after the position before it (`predicted[i]`), and every draft before it stood. Greedy
    decoding with the drafts accepted is then exactly greedy decoding without them."""
    n = 0
    for draft, argmax in zip(drafts, predicted):
        if draft != int(argmax):
            break
        n += 1
    return n


class Verifier:
    """Checks and runs an engine's verify calls."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.blocks = engine.blocks
        self.art = engine.art
        self.rt = engine.rt
        self.window = engine.window
        self.max_verify_tokens = engine.max_verify_tokens
        # Which drafts a verify call keeps (a test swaps in a wrong rule as the control).
        self.accept = accepted_drafts

    @property
    def ring_positions(self) -> int:
        return self.engine.ring_positions

    def check_speculation(self) -> None:
        """RequestError unless this model can verify drafts at all."""
        if not self.blocks.rewinds:
            raise RequestError("speculation is refused for a model with linear-attention "
                               "layers: their state folds in every token fed to it and cannot "
                               "be cut back to the accepted drafts", "speculation")
        if not self.max_verify_tokens:
            raise RequestError("the artifact has no verify entries, so drafts cannot be "
                               "checked (export it with --verify-tokens)", "speculation")

    def check_verify(self, seq: Sequence, tokens: list[int], drafts: int) -> None:
        """RequestError unless `tokens`, of which the last `drafts` are drafts, can be verified
        in one call on `seq`: a held sequence whose history can be cut back to what is
        accepted, at most the largest verify entry's tokens, within a ring's spare positions."""
        self.check_speculation()
        if not seq.token_ids:
            raise RequestError("a sequence's first request cannot carry drafts: the prompt "
                               "runs first, drafts come with later requests", "speculation")
        if not 1 <= drafts < len(tokens):
            raise RequestError(f"draft_tokens {drafts}: expected 1 to {len(tokens) - 1} (the "
                               f"request's tokens after its first)", "speculation")
        n = len(seq.uncached) + len(tokens)
        if n > self.max_verify_tokens:
            raise RequestError(f"{n} tokens in one verify call; this artifact's verify entries "
                               f"take at most {self.max_verify_tokens}", "speculation")
        if self.window is not None and n > self.engine.ring_room(seq):
            raise RequestError(f"{drafts} drafts: a call of {n} tokens needs more positions "
                               f"than its ring of {self.ring_positions} holds "
                               f"past the window of {self.window} ({self.engine.ring_room(seq)})",
                               "speculation")

    def rewind(self, seq: Sequence, length: int) -> None:
        """Cut `seq` back to its first `length` tokens before a request appends others (a
        draft model's sequence, whose drafts its target rejected), or RequestError leaving it
        as it was: a linear-attention state cannot be cut back, and a ring gives back only
        positions that overwrote nothing its window still needs."""
        if not self.blocks.rewinds:
            raise RequestError("a sequence with linear-attention layers cannot be rewound: "
                               "their state folds in every token fed to it", "rewind")
        if not 1 <= length <= len(seq.token_ids):
            raise RequestError(f"keep_tokens {length}: expected 1 to {len(seq.token_ids)} "
                               f"(the sequence's tokens)", "rewind")
        if self.window is not None:
            # Positions below `lost` were written over by later ones in the ring; the next
            # call needs the window before the cut.
            lost = seq.num_cached - self.ring_positions
            cached = self.blocks.cached_after_cut(seq, length)
            if lost > max(0, cached - (self.window - 1)):
                raise RequestError(f"keep_tokens {length}: the ring of "
                                   f"{self.ring_positions} positions no longer "
                                   f"holds the window of {self.window} before position "
                                   f"{cached}", "rewind")
        self.blocks.truncate(seq, length)

    def verify(self, seqs: list[Sequence], drafts: list[int], logits: bool = False,
               acceptors: list[Acceptor | None] | None = None) -> list[Verified]:
        """One verify call: each sequence's uncached tokens, the last `drafts[i]` of them
        drafts. Each row keeps the drafts the model agrees with (`accept`), or those its
        acceptor keeps (sampled speculation: `acceptors[i]`, given the logits after the token
        before the drafts and after each draft), and is cut back to them: the KV written for the
        others lies past its length, is never read, and is written over; pages it no longer
        needs are released. While the entry for all rows compiles, one call per group of as
        many rows as a compiled entry holds."""
        acceptors = acceptors or [None] * len(seqs)
        feeds = [s.uncached for s in seqs]
        n = max(len(f) for f in feeds)
        end = max(s.num_cached + len(f) for s, f in zip(seqs, feeds))
        entry = self.engine.entry_for("verify", len(seqs), end, n)
        if entry is None:
            rows = self.engine.compiled_rows("verify", len(seqs), end, n)
            return [v for i in range(0, len(seqs), rows)
                    for v in self.verify(seqs[i:i + rows], drafts[i:i + rows], logits,
                                         acceptors[i:i + rows])]
        step = self.engine.step_inputs(entry, seqs, feeds)
        sampled = any(a is not None for a in acceptors)
        argmax, position_logits = self.rt.run_positions(entry.name, step, logits or sampled)
        out = []
        for r, (s, feed, d, acceptor) in enumerate(zip(seqs, feeds, drafts, acceptors)):
            # Rows are right-aligned, so the row's last token is in the last column, and the
            # argmax in a column predicts the token in the next one.
            before = argmax.shape[1] - d - 1  # the column of the token before the drafts
            row_drafts = feed[len(feed) - d:]
            if acceptor is None:
                m = self.accept(row_drafts, argmax[r, before:before + d])
                following = int(argmax[r, before + m])
            else:
                m, following = acceptor(position_logits[r, before:], row_drafts)
                assert 0 <= m <= d, f"an acceptor kept {m} of {d} drafts"
            last = before + m
            s.num_cached += len(feed) - d + m
            self.blocks.truncate(s, s.num_cached)
            if position_logits is not None and not np.isfinite(position_logits[r, last]).all():
                self.blocks.withhold(s)  # as Engine._call: its KV may hold NaN
            else:
                self.blocks.register(s)
            out.append(Verified(row_drafts[:m] + [following],
                                np.array(position_logits[r, last]) if logits else None))
        return out

    def most_drafts(self) -> int:
        """The most drafts any verify call can check after a sequence's next token: within the
        largest verify entry and, once a ring's window is full, its spare positions."""
        room = self.max_verify_tokens
        if self.window is not None:
            room = min(room, self.engine.ring_room(None))
        return max(0, room - 1)

    def verify_room(self, seq: Sequence) -> int:
        """How many drafts a verify call can check after `seq`'s next token: within the
        largest verify entry, the largest context and a ring's spare positions."""
        room = min(self.max_verify_tokens, self.art.max_context - len(seq.token_ids))
        if self.window is not None:
            room = min(room, self.engine.ring_room(seq))
        return max(0, room - 1)

    def greedy_step(self, seq: Sequence, token: int, drafts: list[int]) -> list[int]:
        """Feed `token` (and verify `drafts` after it): the ids it yields."""
        seq.token_ids += [token] + drafts
        if drafts:
            return self.verify([seq], [len(drafts)])[0].accepted
        return [int(np.argmax(self.engine.decode([seq])[0]))]

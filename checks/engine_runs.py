"""What the engine gives for an artifact, compared by tests against a reference (transformers,
or the same model exported another way): one sequence alone, and two decoding together."""

from __future__ import annotations

import numpy as np

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime.core import Runtime


def alone_and_together(art, prompt_a: list[int], prompt_b: list[int], steps: int,
                       **runtime) -> dict:
    """A's greedy ids alone ("alone"); A's first logits after its prompt in chunks ("first");
    A and B decoding together, their ids ("together") and the last step's logits ("last");
    the runtime ("rt") for its counters."""
    rt = Runtime(art, **runtime)
    engine = Engine(rt)
    alone = engine.generate_greedy(prompt_a, steps).generated_ids
    a, b = engine.new_sequence(prompt_a), engine.new_sequence(prompt_b)
    first = engine.prefill_chunked(a)[0]
    together, last = decode_together(engine, [a, b],
                                     np.stack([first, engine.prefill_chunked(b)[0]]), steps)
    engine.free(a)
    engine.free(b)
    return {"first": first, "alone": alone, "together": together, "last": last, "rt": rt}


def decode_together(engine, seqs: list, logits, steps: int) -> tuple[list[list[int]], object]:
    """`steps` greedy tokens for each of `seqs` from their `logits` [len(seqs), vocab], one
    decode call a step for all of them: their ids, and the last call's logits."""
    ids = [[] for _ in seqs]
    for _ in range(steps):
        for i, seq in enumerate(seqs):
            t = int(np.argmax(logits[i]))
            ids[i].append(t)
            seq.token_ids.append(t)
        logits = engine.decode(seqs)
    return ids, logits


def adapters_together(engine, prompts: list[list[int]], slots, steps: int):
    """Each prompt's greedy ids with its adapter slot (0: none), the prompts in chunks, then
    the rows decoding in the same calls; and each prompt's last logits after its prompt."""
    seqs = []
    for prompt, slot in zip(prompts, slots):
        s = engine.new_sequence(prompt)
        s.adapter_slot = slot
        seqs.append(s)
    firsts = np.stack([engine.prefill_chunked(s)[0] for s in seqs])
    ids, _ = decode_together(engine, seqs, firsts, steps)
    for s in seqs:
        engine.free(s)
    return ids, firsts

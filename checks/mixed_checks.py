"""Mixed steps through a served model (shared by tests and scripts): prompts that arrive while a
stream decodes ride its steps, and every generation gives the ids it gives served without
mixed entries."""

from __future__ import annotations

import random
import threading

import numpy as np

from triton_tlaloc.frontends.client import (METRICS_SETTLE_S, TlalocClient, generate, metric,
                                            new_sequence_id, scrape_metrics)

from .reuse_checks import unique_tokens


def check_prompts_join_a_stream(grpc_url, metrics_url, model, apart, seed=0,
                                lengths=(20, 90, 45), new_tokens=16, stream_tokens=100,
                                stream_lora=None, loras=()):
    """A client's stream of `stream_tokens` greedy steps on `model`'s sequence model; once its
    prompt has run, prompts of `lengths` tokens arrive together through the generate model,
    while the stream goes on. Their ids and the stream's equal the same generations through
    `apart` (the same weights without mixed entries, one at a time), and `model` ran steps
    that carried a prompt's chunk and decode rows together. `stream_lora` and `loras` (one a
    prompt, None for none): the LoRA adapters by name, the same on both models."""
    rng = random.Random(seed)
    stream_prompt = unique_tokens(rng, 10)
    prompts = [unique_tokens(rng, n) for n in lengths]
    loras = tuple(loras) or (None,) * len(prompts)

    def sampling(k):
        return {"max_tokens": new_tokens, "ignore_eos": True,
                **({"lora": loras[k]} if loras[k] else {})}

    def mixed_steps() -> float:
        return metric(scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S),
                      "tlaloc_steps_total", model=model, carried="mixed")

    before = mixed_steps()
    got = {}

    def run(k, prompt):
        got[k] = generate(grpc_url, f"{model}_generate", input_ids=prompt,
                          sampling=sampling(k)).token_ids

    threads = [threading.Thread(target=run, args=(k, p)) for k, p in enumerate(prompts)]
    with TlalocClient(grpc_url, model, "grpc") as c:
        seq = new_sequence_id()
        first = c.request(seq, stream_prompt, start=True, lora=stream_lora)["LOGITS"]
        stream = [int(np.argmax(first))]
        for t in threads:  # the stream is decoding from here on
            t.start()
        while len(stream) < stream_tokens:
            logits, _ = c.infer(seq, [stream[-1]], end=len(stream) == stream_tokens - 1)
            stream.append(int(np.argmax(logits)))
    for t in threads:
        t.join(120)
    steps = mixed_steps() - before
    with TlalocClient(grpc_url, apart, "grpc") as c:
        want = {"stream": c.generate_greedy(stream_prompt, stream_tokens,
                                            lora=stream_lora).generated_ids}
    for k, p in enumerate(prompts):
        want[k] = generate(grpc_url, f"{apart}_generate", input_ids=p,
                           sampling=sampling(k)).token_ids
    same = {"stream": stream, **got} == want
    return (f"a {stream_tokens}-token stream and prompts of {list(lengths)} tokens joining it: "
            f"ids {'equal' if same else 'DIFFER'} to the model served apart; {steps:.0f} steps "
            f"carried a prompt and decode rows", same and steps > 0)

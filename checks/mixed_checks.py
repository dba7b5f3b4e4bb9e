"""Mixed steps through a served model (shared by tests and scripts): prompts that arrive while a
stream decodes ride its steps, and every generation gives the ids it gives served without
mixed entries."""

from __future__ import annotations

import random
import threading

from triton_tlaloc.frontends.client import METRICS_SETTLE_S, generate, metric, scrape_metrics

from .reuse_checks import unique_tokens


def check_prompts_join_a_stream(grpc_url, metrics_url, model, apart, seed=0,
                                lengths=(20, 90, 45), new_tokens=16, stream_tokens=100):
    """A stream of `stream_tokens` through `model`'s generate model; once it has streamed its
    first tokens, prompts of `lengths` tokens arrive together. Their ids and the stream's equal
    the same generations through `apart` (the same weights without mixed entries, one at a
    time), and `model` ran steps that carried a prompt's chunk and decode rows together."""
    rng = random.Random(seed)
    stream_prompt = unique_tokens(rng, 10)
    prompts = [unique_tokens(rng, n) for n in lengths]
    sampling = {"max_tokens": new_tokens, "ignore_eos": True}

    def steps_of(values) -> float:
        return metric(values, "tlaloc_steps_total", model=model, carried="mixed")

    before = steps_of(scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S))
    got, threads, streaming = {}, [], threading.Event()

    def run(key, prompt, tokens, on_text=None):
        got[key] = generate(grpc_url, f"{model}_generate", input_ids=prompt,
                            sampling={**sampling, "max_tokens": tokens},
                            on_text=on_text).token_ids

    seen = []
    stream = threading.Thread(target=run, args=("stream", stream_prompt, stream_tokens,
                                                lambda piece: (seen.append(piece),
                                                               len(seen) >= 3 and streaming.set())))
    stream.start()
    streaming.wait(60)
    for k, p in enumerate(prompts):
        threads.append(threading.Thread(target=run, args=(k, p, new_tokens)))
        threads[-1].start()
    for t in [stream, *threads]:
        t.join(120)
    mixed_steps = steps_of(scrape_metrics(metrics_url, settle_s=METRICS_SETTLE_S)) - before
    want = {"stream": generate(grpc_url, f"{apart}_generate", input_ids=stream_prompt,
                               sampling={**sampling, "max_tokens": stream_tokens}).token_ids}
    for k, p in enumerate(prompts):
        want[k] = generate(grpc_url, f"{apart}_generate", input_ids=p,
                           sampling=sampling).token_ids
    same = got == want
    return (f"a {stream_tokens}-token stream and prompts of {list(lengths)} tokens joining it: "
            f"ids {'equal' if same else 'DIFFER'} to the model served apart; {mixed_steps:.0f} "
            f"steps carried a prompt and decode rows", same and mixed_steps > 0)

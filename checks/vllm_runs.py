"""vLLM's `LLM` on an artifact through the tlaloc platform plugin, in a process of its own (each
run a fresh engine): what tests/vllm check. Run in vLLM's environment (.venv-vllm):

    python -m checks.vllm_runs ARTIFACT '{"prompts": [[1, 2, 3]], "steps": 16, "together": true,
                                          "llm": {"block_size": 16, "max_model_len": 256}}'

prints one JSON line: each prompt's ids (greedy, or drawn as its entry of "sampling" asks: a
SamplingParams' fields by name), their logprobs and the prompt's where asked ([[token id,
logprob], ...] a token), vLLM's count of its prompt tokens found in its prefix cache, and the
worker's entry calls; or {"error": "..."} when the engine refuses to start. Prompts run all at once with "together", else
one after another (later ones finding what the earlier ones cached)."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_PLUGINS", "tlaloc")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from vllm import LLM, SamplingParams

    art, spec = argv[0], json.loads(argv[1])
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, **spec.get("llm", {})}
    try:
        llm = LLM(model=art, **kwargs)
    except Exception as e:  # the refusal, as the engine reports it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 0
    asked = spec.get("sampling") or [{}] * len(spec["prompts"])
    # (JSON keys are strings; a logit bias is keyed by token id)
    asked = [{**a, **({"logit_bias": {int(k): v for k, v in a["logit_bias"].items()}}
                      if "logit_bias" in a else {})} for a in asked]
    sampling = [SamplingParams(**{"temperature": 0.0, "max_tokens": spec.get("steps", 16),
                                  "ignore_eos": True, "detokenize": False, **a}) for a in asked]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    if spec.get("together"):
        outs = llm.generate(prompts, sampling, use_tqdm=False)
    else:
        outs = [llm.generate([p], s, use_tqdm=False)[0] for p, s in zip(prompts, sampling)]

    def scored(steps):  # (a prompt's first token's is None: nothing before it)
        return None if steps is None else [
            None if step is None else [[t, lp.logprob] for t, lp in sorted(step.items())]
            for step in steps]
    print(json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                      "logprobs": [scored(o.outputs[0].logprobs) for o in outs],
                      "prompt_logprobs": [scored(o.prompt_logprobs) for o in outs],
                      "cached": [o.num_cached_tokens or 0 for o in outs],
                      "calls": llm.collective_rpc("get_runner_calls")[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A vLLM platform plugin that runs a Tlaloc serving artifact's entries (`VLLM_PLUGINS=tlaloc`):
vLLM keeps its scheduler, block manager (prefix caching, preemption), tokenizer and OpenAI
server; its worker (worker.py) runs the scheduled rows on the artifact's compiled entries
(runner.py) instead of building a torch model, with vLLM's block tables as the artifact's page
tables and the artifact's pools as vLLM's KV cache (docs/design.md#under-vllm).

    VLLM_PLUGINS=tlaloc python -c "from vllm import LLM; LLM(model='ARTIFACT_DIR')"
    VLLM_PLUGINS=tlaloc python -m vllm.entrypoints.openai.api_server --model ARTIFACT_DIR

The entry point (`vllm.platform_plugins`, name tlaloc) answers only when VLLM_PLUGINS names it:
with VLLM_PLUGINS unset vLLM loads every installed platform plugin, and an active one takes
over every vLLM run of the environment.
"""

from __future__ import annotations

import os

PLUGIN = "tlaloc"


def platform() -> str | None:
    """vLLM's platform plugin entry point: the platform's class, or None when not asked for."""
    if PLUGIN not in os.environ.get("VLLM_PLUGINS", "").split(","):
        return None
    # The scheduler's version-1 model-runner protocol (a resumed request's tokens sent whole),
    # which the worker follows; inherited by vLLM's engine process.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return "triton_tlaloc.vllm_plugin.platform.TlalocPlatform"

"""A tiny qwen3 taught two answers by heart, so that what the server reads from a model's own
text (a hermes tool call under `tool_choice: auto`, a `<think>` block) is tested on a real
model's greedy output through a real server, not on scripted text.

Its tokenizer is a byte-level BPE of printable ASCII (checks/schemas.byte_level_bpe) with
ChatML's markers; its chat template renders the request's tools and teaches the hermes format
(`<tool_call>...</tool_call>`) and a thinking block, so `--tool-call-parser auto` and
`--reasoning-parser auto` pick hermes and qwen3 from it. A random qwen3 of the tiny shape
(checks/oracle.make_tiny_checkpoint's) is trained with Adam on the two chats until every
answer token is the argmax after the tokens before it by a margin, then saved as a Hugging
Face checkpoint with the tokenizer files. About 10 s on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]  # <|im_end|> is id 2, the eos
EOS = 2

TEMPLATE = """\
{#- The model thinks in <think>...</think> before it answers; it calls tools as hermes does. -#}
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %} {{ tool.function.name }}{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# (messages, tools, the answer it is taught)
CALL = ([{"role": "user", "content": "What is the weather in Paris?"}], [WEATHER],
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
THOUGHT = ([{"role": "user", "content": "Hi!"}], None,
           "<think>\nA greeting.\n</think>\n\nHello there!")
ANSWERS = (CALL, THOUGHT)

MARGIN = 2.0  # each answer token's logit over the next best, when training stops


def write_tokenizer(directory: Path) -> None:
    from .schemas import byte_level_bpe

    directory.mkdir(parents=True, exist_ok=True)
    tok = byte_level_bpe(256, SPECIALS, ascii_only=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<s>", "unk_token": "<unk>"}))
    (directory / "chat_template.jinja").write_text(TEMPLATE)


def examples(directory: Path) -> list[tuple[list[int], list[int]]]:
    """Each taught chat as (its prompt ids, as the chat template renders them, its answer ids
    with the eos)."""
    from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer

    tok = ArtifactTokenizer(directory)
    out = []
    for messages, tools, answer in ANSWERS:
        variables = {"tools": tools} if tools else {}
        prompt = tok.apply_chat_template(messages, **variables)
        out.append((prompt, tok.encode(answer, add_special_tokens=False) + [EOS]))
    return out


def make_taught_checkpoint(out: Path, seed: int = 0, max_steps: int = 600) -> Path:
    """The taught qwen3 saved at `out` (a Hugging Face checkpoint with its tokenizer)."""
    import torch

    from .oracle import make_tiny_checkpoint

    make_tiny_checkpoint(out, "qwen3", seed=seed)
    write_tokenizer(out)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.train()
    pairs = examples(out)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(max_steps):
        loss, worst = 0.0, float("inf")
        for prompt, answer in pairs:
            ids = torch.tensor([prompt + answer])
            logits = model(ids).logits[0, len(prompt) - 1:-1]
            target = torch.tensor(answer)
            loss = loss + torch.nn.functional.cross_entropy(logits, target)
            with torch.no_grad():
                chosen = logits.gather(1, target[:, None])[:, 0]
                others = logits.scatter(1, target[:, None], float("-inf")).max(dim=1).values
                worst = min(worst, float((chosen - others).min()))
        if worst >= MARGIN:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise RuntimeError(f"the taught model did not learn its answers in {max_steps} steps "
                           f"(worst margin {worst:.2f})")
    model.eval()
    model.save_pretrained(out)
    return out


__all__ = ["ANSWERS", "CALL", "EOS", "THOUGHT", "WEATHER", "make_taught_checkpoint"]

"""Reasoning on `/v1/chat/completions` (docs/serving.md#reasoning): a model that thinks in a
`<think>...</think>` block before it answers (qwen3, DeepSeek-R1) has the block's text
returned as `message.reasoning_content` (streamed as `delta.reasoning_content`) and the answer
after it as `content`, as vLLM's reasoning parsers return them.

- qwen3: the model opens the block itself, first: an answer that does not start with
  `<think>` is all content (the template's `enable_thinking: false` puts an empty block in
  the prompt); one cut short before `</think>` is all reasoning.
- deepseek_r1: the template opens the block in the prompt, so the answer starts inside it:
  everything before `</think>` is reasoning (all of it, if the tag never comes).

`tlaloc openai --reasoning-parser qwen3|deepseek_r1|none|auto`; auto picks qwen3 for a
template that mentions `<think>`, none otherwise.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def parser_for_template(template: str | None) -> str | None:
    return "qwen3" if template and OPEN in template else None


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a part it does not have."""
    if parser == "qwen3":
        if not text.lstrip().startswith(OPEN):
            return None, text
        body = text.lstrip()[len(OPEN):]
    else:
        body = text
    end = body.find(CLOSE)
    if end < 0:
        return body or None, None
    content = body[end + len(CLOSE):]
    return body[:end] or None, content or None


class ReasoningStream:
    """A streamed answer's pieces as (field, text) parts, field "reasoning_content" or
    "content"; a piece that may be the start of a tag is held back until it is known."""

    def __init__(self, parser: str):
        self.parser = parser
        # deepseek_r1 starts inside the block; qwen3 only once it writes <think> first
        self.state = "thinking" if parser == "deepseek_r1" else "start"
        self.held = ""

    def push(self, piece: str) -> list[tuple[str, str]]:
        self.held += piece
        out = []
        while True:
            if self.state == "start":  # qwen3, before anything: <think> or content
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.held, self.state = stripped[len(OPEN):], "thinking"
                    continue
                if OPEN.startswith(stripped):
                    return out  # maybe the tag: wait
                self.state = "answer"
                continue
            if self.state == "thinking":
                at = self.held.find(CLOSE)
                if at >= 0:
                    if at:
                        out.append(("reasoning_content", self.held[:at]))
                    self.held, self.state = self.held[at + len(CLOSE):], "answer"
                    continue
                keep = partial_tag(self.held, CLOSE)
                if len(self.held) > keep:
                    out.append(("reasoning_content", self.held[:len(self.held) - keep]))
                    self.held = self.held[len(self.held) - keep:]
                return out
            if self.held:
                out.append(("content", self.held))
                self.held = ""
            return out

    def end(self) -> list[tuple[str, str]]:
        """What is held when the answer ends."""
        held, self.held = self.held, ""
        if not held:
            return []
        return [("reasoning_content" if self.state == "thinking" else "content", held)]


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what a stream holds back
    until it knows whether the tag comes; tool_calls.py's markers too)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-k:])), 0)


__all__ = ["PARSERS", "ReasoningStream", "parser_for_template", "partial_tag", "split"]

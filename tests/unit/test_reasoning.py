"""Reasoning on `tlaloc openai` (frontends/reasoning.py): a `<think>` block's text returned as
reasoning_content and the answer after it as content, whole and streamed (the deltas joining to
the whole answer's parts whatever the pieces), with tool calls read from the answer only;
chat_template_kwargs reaching the template (a qwen3-style enable_thinking switch), and the
server's own variables refused. Through uvicorn and the `openai` package in front of a scripted
generate (no Triton)."""

from __future__ import annotations

import json

import openai
import pytest
from test_chat_messages import write_tokenizer
from test_tool_calls import WEATHER, scripted

from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread
from triton_tlaloc.frontends.reasoning import ReasoningStream, parser_for_template, split
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer

# The part of qwen3's chat template that matters here: with enable_thinking false, the
# generation prompt holds an empty thinking block, so the model answers at once.
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nThey greet me.\n</think>\n\nHello!", "\nThey greet me.\n", "\n\nHello!"),
    ("qwen3", "Hello!", None, "Hello!"),  # enable_thinking false: no block
    ("qwen3", "<think>\nStill thinking when cut", "\nStill thinking when cut", None),
    ("qwen3", "<think></think>Hi", None, "Hi"),
    ("deepseek_r1", "They greet me.</think>Hello!", "They greet me.", "Hello!"),
    ("deepseek_r1", "No end tag yet", "No end tag yet", None),
])
def test_the_block_is_reasoning_and_what_follows_is_content(parser, text, reasoning, content):
    assert split(parser, text) == (reasoning, content)


@pytest.mark.parametrize("parser, text", [
    ("qwen3", "<think>\nThey greet me. 1 < 2 </thin\n</think>\n\nHello <b>!"),
    ("qwen3", "Hello <think> is not a tag here"),
    ("deepseek_r1", "Think</think>Answer"),
])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_parts_join_to_the_whole_answers(parser, text, size):
    stream = ReasoningStream(parser)
    parts = [p for i in range(0, len(text), size) for p in stream.push(text[i:i + size])]
    parts += stream.end()
    joined = {"reasoning_content": None, "content": None}
    for kind, piece in parts:
        joined[kind] = (joined[kind] or "") + piece
    assert (joined["reasoning_content"], joined["content"]) == split(parser, text)


def test_auto_finds_qwen3_by_the_think_tag():
    assert parser_for_template(QWEN3_LIKE) == "qwen3" and parser_for_template("{{ x }}") is None


@pytest.fixture
def served(tmp_path):
    stops = []

    def start(answer: str, reasoning_parser: str = "auto"):
        generate, asked = scripted(answer)
        tok = Recording(write_tokenizer(tmp_path, QWEN3_LIKE))
        model = ServedModel("m", "m_generate", tok, 200, reasoning_parser=reasoning_parser)
        base, stop = serve_in_thread("unused:8001", {"m": model}, generate=generate)
        stops.append(stop)
        return openai.OpenAI(base_url=base, api_key="unused", max_retries=0), tok
    yield start
    for stop in stops:
        stop()


class Recording(ArtifactTokenizer):
    """The real tokenizer, its renders kept."""

    def apply_chat_template(self, messages, **variables):
        self.texts = getattr(self, "texts", []) + [self.render(messages, **variables)]
        return super().apply_chat_template(messages, **variables)


MESSAGES = [{"role": "user", "content": "Hi"}]


def test_the_openai_client_gets_reasoning_content_whole_and_streamed(served):
    client, tok = served("<think>\nThey greet me.\n</think>\n\nHello!")
    got = client.chat.completions.create(model="m", messages=MESSAGES)
    message = got.choices[0].message
    assert message.reasoning_content == "\nThey greet me.\n"
    assert message.content == "\n\nHello!" and got.choices[0].finish_reason == "stop"
    thought, content = "", ""
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (thought, content) == (message.reasoning_content, message.content)
    # none: the text as it came
    client, _ = served("<think>x</think>y", reasoning_parser="none")
    message = client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message
    assert message.content == "<think>x</think>y"
    assert getattr(message, "reasoning_content", None) is None


def test_chat_template_kwargs_reach_the_template_and_the_servers_own_are_refused(served):
    client, tok = served("Hello!")
    client.chat.completions.create(model="m", messages=MESSAGES,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert tok.texts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    client.chat.completions.create(model="m", messages=MESSAGES)
    assert tok.texts[-1].endswith("<|im_start|>assistant\n")  # the control: thinking on
    for kwargs in ({"add_generation_prompt": False}, {"messages": []}, {"not a name": 1}):
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs: "):
            client.chat.completions.create(model="m", messages=MESSAGES,
                                           extra_body={"chat_template_kwargs": kwargs})


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(served):
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    client, _ = served(f"<think>I need the weather.</think>\n<tool_call>\n{json.dumps(call)}\n"
                       f"</tool_call>", reasoning_parser="qwen3")
    got = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER])
    message = got.choices[0].message
    assert message.reasoning_content == "I need the weather."
    assert got.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [(call["name"], call["arguments"])]
    thought, args = "", ""
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                                stream=True):
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        args += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
    assert thought == message.reasoning_content and args == message.tool_calls[0].function.arguments

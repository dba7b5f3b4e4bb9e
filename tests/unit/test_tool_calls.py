"""Tool calling on `tlaloc openai` (frontends/tool_calls.py): tools and tool_choice checked by
name, the constraint a required or named call is generated under, the prompt for a template
with and without tools, the parsers, and streamed deltas that join to the whole answer's
tool_calls; through a real uvicorn server and the `openai` package, in front of a generate
that answers with a script (no Triton; the real model: tests/test_generate.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from triton_tlaloc.frontends.client import GenerateResult
from triton_tlaloc.frontends.http_doors import APIError
from triton_tlaloc.frontends.openai_requests import ServedModel
from triton_tlaloc.frontends.openai_server import serve_in_thread
from triton_tlaloc.frontends.tool_calls import (ToolCallStream, ToolPlan, parse,
                                                parser_for_template)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"]}}}


def plan(**body) -> ToolPlan:
    return ToolPlan.of({"tools": [WEATHER, TIME], **body}, "hermes")


@pytest.mark.parametrize("body, says", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "strin"}}}]}, "tools[0].function.parameters: "),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name: 'nope' is not in tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, 'tool_choice: "always"'),
    ({"tool_choice": "required"}, "tool_choice: required, with no tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name: "),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]: an object of type function"),
    ({"tools": "get_weather"}, "tools: a list of tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls: true or false"),
])
def test_bad_tools_are_refused_by_name(body, says):
    with pytest.raises(APIError, match="^" + re.escape(says)):
        ToolPlan.of(body, "hermes")


def test_required_and_named_calls_are_generated_under_a_schema():
    """A named function: its parameters schema, the answer its arguments. Required: an array
    of calls (one at most when parallel_tool_calls is false), each a tool's name and its
    arguments, read back as the calls."""
    assert ToolPlan.of({}, "hermes") is None
    assert plan().choice == "auto" and plan().structured_output() is None
    named = plan(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.structured_output() == {"json_schema": TIME["function"]["parameters"],
                                         "strict": False}
    assert named.calls('{"zone": "UTC"}')[1][0].as_dict()["function"] == {
        "name": "get_time", "arguments": '{"zone": "UTC"}'}
    required = plan(tool_choice="required", parallel_tool_calls=False)
    schema = required.structured_output()["json_schema"]
    answer = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]
    jsonschema.validate(answer, schema)
    for wrong in ([], answer * 2, [{"name": "get_weather", "arguments": {"city": "Oslo"}}],
                  [{"name": "get_time", "arguments": {"city": "Oslo", "unit": "c"}}]):
        with pytest.raises(jsonschema.ValidationError):  # the control: the schema refuses
            jsonschema.validate(wrong, schema)
    content, calls = required.calls(json.dumps(answer))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]


def test_the_prompt_for_a_template_with_tools_and_without():
    """With a `tools` variable the template gets the tools and the calls' arguments as
    objects; without one, hermes' format: the tools in the system turn, calls as blocks,
    results as tool_response blocks of a user turn."""
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]
    p = plan()
    rendered, variables = p.prompt(messages, takes_tools=True)
    assert variables == {"tools": [WEATHER, TIME]}
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo",
                                                                     "unit": "c"}
    rendered, variables = p.prompt(messages, takes_tools=False)
    assert variables == {} and [m["role"] for m in rendered] == ["system", "user", "assistant",
                                                                  "user"]
    assert json.dumps(WEATHER) in rendered[0]["content"] and "<tools>" in rendered[0]["content"]
    block = rendered[2]["content"]
    assert block.startswith("<tool_call>\n") and block.endswith("\n</tool_call>")
    assert json.loads(block.split("\n")[1]) == {"name": "get_weather",
                                                "arguments": {"city": "Oslo", "unit": "c"}}
    assert rendered[3]["content"] == "<tool_response>\n4 degrees\n</tool_response>"
    with_system = p.prompt([{"role": "system", "content": "Be brief."}] + messages, False)[0]
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
               '\n</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
               '</tool_call>', "Let me look.",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', None,
     [("get_time", {"zone": "UTC"})]),  # cut before its closing tag, at the end token
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", "It is sunny.", "It is sunny.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '{"answer": 4}', '{"answer": 4}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     "Sure.", [("get_time", {"zone": "UTC"})]),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None,
     [("get_time", {"zone": "UTC"})]),  # [TOOL_CALLS] is a special token, decoded away
])
def test_each_parser_reads_the_calls_its_models_write(parser, text, content, calls):
    got_content, got = parse(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_auto_picks_the_parser_by_the_templates_markers():
    assert parser_for_template("{{ '<tool_call>' }}{% for tool in tools %}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|>{{ tools }}") == "llama3_json"
    assert parser_for_template(None) == "hermes"


def streamed(p: ToolPlan, pieces: list[str]) -> tuple[str | None, list[dict]]:
    """What a client joins from the deltas: the content and the tool calls by index."""
    s = ToolCallStream(p)
    deltas = [d for piece in pieces for d in s.push(piece)] + s.end("".join(pieces))
    content, calls = None, {}
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        for c in d.get("tool_calls", []):
            have = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                assert have["name"] is None, "a call's name comes once, first"
                have["name"] = c["function"]["name"]
            have["arguments"] += c["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_streamed_deltas_join_to_the_whole_answers_calls(split):
    """Whatever the pieces, a stream's content and calls (name first, then arguments) are
    the whole answer's: content before a hermes call streams, the marker split across pieces
    is held back; a named call streams its arguments as they come."""
    text = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}\n</tool_call>')
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    content, calls = streamed(plan(), pieces)
    whole_content, whole = plan().calls(text)
    assert content.strip() == whole_content == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in whole]
    named = plan(tool_choice={"type": "function", "function": {"name": "get_time"}})
    args = '{"zone": "Europe/Oslo"}'
    assert streamed(named, [args[i:i + split] for i in range(0, len(args), split)]) == (
        None, [{"name": "get_time", "arguments": args}])
    plain = "No tools needed: it is 4 < 5."
    assert streamed(plan(), [plain[i:i + split] for i in range(0, len(plain), split)]) == (
        plain, [])
    required = plan(tool_choice="required")
    array = ('[ {"name": "get_weather", "arguments": {"city": "O\\"slo [x]", "unit": "c"}},'
             '\n{"arguments" : {"zone": "UTC"}, "name":"get_time"} ]')
    whole_content, whole = required.calls(array)
    assert whole_content is None and [(c.name, json.loads(c.arguments)) for c in whole] == [
        ("get_weather", {"city": 'O"slo [x]', "unit": "c"}), ("get_time", {"zone": "UTC"})]
    assert streamed(required, [array[i:i + split] for i in range(0, len(array), split)]) == (
        None, [{"name": c.name, "arguments": c.arguments} for c in whole])


def test_a_required_call_streams_its_name_then_its_arguments_as_they_come():
    """A required answer's first call goes out before the array ends: its name once the name's
    string closes, its arguments' text as it grows (not held to the end); an answer cut short
    before any name is content."""
    stream = ToolCallStream(plan(tool_choice="required"))
    assert stream.push('[{"name": "get_wea') == []
    named, begun = stream.push('ther", "arguments": {"ci')
    assert named["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert begun == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.push('ty": "Oslo"') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"'}}]}]
    first = stream.calls[0].id
    stream.push("}}]")
    assert stream.end("") == [] and stream.calls[0].id == first
    cut = ToolCallStream(plan(tool_choice="required"))
    assert cut.push('[{"na') == [] and cut.end('[{"na') == [{"content": '[{"na'}]


# ------------------------------------------------------------------ through the server

class Tokenizer:
    chat_template = None  # no tools of its own: hermes' format goes in the prompt
    takes_tools = False

    def __init__(self):
        self.rendered = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text[:64]]

    def apply_chat_template(self, messages: list[dict], **variables) -> list[int]:
        self.rendered.append((messages, variables))
        return [1, 2, 3]


def scripted(answer: str):
    """A generate that writes `answer` (in pieces, when streamed) and records its sampling."""
    asked = []

    def generate(url, model, *, input_ids, sampling, stream, on_text, cancel):
        asked.append(sampling)
        if stream:
            for i in range(0, len(answer), 5):
                on_text(answer[i:i + 5])
        return GenerateResult(answer, [1] * 4, "stop", 3, 4, 1, 1.0)
    return generate, asked


@pytest.fixture
def served():
    stops = []

    def start(answer: str, parser: str = "auto"):
        import openai

        generate, asked = scripted(answer)
        tok = Tokenizer()
        model = ServedModel("m", "m_generate", tok, 100, tool_parser=parser)
        base, stop = serve_in_thread("unused:8001", {"m": model}, generate=generate)
        stops.append(stop)
        return openai.OpenAI(base_url=base, api_key="unused", max_retries=0), asked, tok
    yield start
    for stop in stops:
        stop()


def test_the_openai_client_gets_tool_calls_whole_and_streamed(served):
    """An `auto` answer in hermes' format reaches the openai package as message.tool_calls with
    finish_reason tool_calls, and streamed as delta.tool_calls that join to the same call; a
    named call's arguments are the answer, generated under the function's schema."""
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' \
             '\n</tool_call>'
    client, asked, tok = served(answer)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    got = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER, TIME])
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "c"}
    assert "structured_output" not in asked[-1]
    assert "<tools>" in tok.rendered[-1][0][0]["content"]  # hermes' format in the prompt

    names, args, finish = [], "", None
    for chunk in client.chat.completions.create(model="m", messages=messages,
                                                tools=[WEATHER, TIME], stream=True):
        delta = chunk.choices[0].delta
        for c in delta.tool_calls or []:
            if c.function.name:
                names.append(c.function.name)
            args += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and args == call.function.arguments
    assert finish == "tool_calls"

    client, asked, _ = served('{"zone": "UTC"}')
    got = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = got.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", '{"zone": "UTC"}')
    assert asked[-1]["structured_output"] == {"json_schema": TIME["function"]["parameters"],
                                              "strict": False}


def test_mistral_calls_keep_their_special_marker_in_the_text(served):
    """Mistral's calls start with the special token [TOOL_CALLS]: under auto its generation's
    text keeps special tokens (skip_special_tokens false, as vLLM's mistral parser asks), and
    the call is read; other parsers, and a client's own choice, are left as they are."""
    answer = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    messages = [{"role": "user", "content": "Time?"}]
    client, asked, _ = served(answer, "mistral")
    got = client.chat.completions.create(model="m", messages=messages, tools=[TIME])
    assert asked[-1]["skip_special_tokens"] is False
    assert got.choices[0].message.tool_calls[0].function.name == "get_time"
    client.chat.completions.create(model="m", messages=messages, tools=[TIME],
                                   extra_body={"skip_special_tokens": True})
    assert asked[-1]["skip_special_tokens"] is True
    client, asked, _ = served(answer, "hermes")
    client.chat.completions.create(model="m", messages=messages, tools=[TIME])
    assert "skip_special_tokens" not in asked[-1]


def test_bad_tools_are_a_400_and_nothing_is_generated(served):
    import openai

    client, asked, _ = served("unused")
    messages = [{"role": "user", "content": "hi"}]
    for kw, says in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
                        "name": "get_time"}}}, "tool_choice.function.name"),
                     ({"tools": [{"type": "function", "function": {
                         "name": "f", "parameters": {"type": "strin"}}}]},
                      "tools[0].function.parameters"),
                     ({"tools": [WEATHER], "tool_choice": "required",
                       "response_format": {"type": "json_object"}}, "at most one constraint")):
        with pytest.raises(openai.BadRequestError, match=re.escape(says)):
            client.chat.completions.create(model="m", messages=messages, **kw)
    assert asked == []

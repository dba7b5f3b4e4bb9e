"""Tool calling on `/v1/chat/completions` (docs/serving.md#tool-calling): a request's `tools`,
`tool_choice` and `parallel_tool_calls` checked by name, the tools put in the prompt, and what
the model wrote read back as OpenAI's `tool_calls`.

- `ToolPlan.of(body, ...)`: what a request asks. `tool_choice` "none" (the tools are in the
  prompt, nothing is parsed), "auto" (the model chooses; its text is parsed for calls in the
  model's format), "required" (at least one call) or a named function (that one call). The
  last two are enforced with structured output: "required" as a JSON array of calls, a named
  function as its `parameters` schema, so the arguments always validate.
- The prompt: a template with a `tools` variable renders them itself (its calls and tool
  results too, their arguments given as objects, as transformers gives them). One without
  gets hermes' format, which most chat models know: the tools described in the system turn,
  calls written back as `<tool_call>` blocks and results as `<tool_response>` blocks of a user
  turn.
- The parsers (`--tool-call-parser`): hermes (`<tool_call>{"name", "arguments"}</tool_call>`),
  llama3_json (`{"name", "parameters"}` objects, `;`-separated, after an optional
  `<|python_tag|>`), mistral (`[TOOL_CALLS]` and a JSON array); `auto` picks by the chat
  template's markers (hermes for a template without tools, since that is the format put in
  its prompt).
- `ToolCallStream`: a streamed answer's pieces as OpenAI's deltas. A named call streams its
  arguments as they come (its name first); otherwise text streams as content until a call's
  marker may have begun, and the calls go out when the answer ends, each its name and then its
  arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .http_doors import APIError, shown, typed
from .reasoning import partial_tag

PARSERS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template teaches its model (for `--tool-call-parser auto`)."""
    template = template or ""
    if MISTRAL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"  # its tags, or a template without tools (hermes' format is put in)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# ------------------------------------------------------------------ the request

def _tools(body: dict) -> list[dict]:
    tools = typed(body, "tools", (list,), "a list of tools")
    if tools is None:
        return []
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: {len(tools)} tools, over the {MAX_TOOLS} this server takes")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{where}: an object of type function, not {shown(tool)}")
        fn = typed(tool, "function", (dict,), "an object with name and parameters", f"{where}.")
        if fn is None:
            raise APIError(400, f"{where}.function: required")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise APIError(400, f"{where}.function.name: {shown(name)}: 1 to 64 letters, digits, "
                                f"_ . or -")
        if name in names:
            raise APIError(400, f"{where}.function.name: {name!r} is given twice")
        names.add(name)
        typed(fn, "description", (str,), "a string", f"{where}.function.")
        params = typed(fn, "parameters", (dict,), "a JSON schema object", f"{where}.function.")
        strict = typed(fn, "strict", (bool,), "true or false", f"{where}.function.")
        _check_schema(params if params is not None else {}, bool(strict),
                      f"{where}.function.parameters")
        checked.append({"type": "function", "function": {
            **fn, "parameters": params if params is not None else
            {"type": "object", "properties": {}}}})
    return checked


def _check_schema(schema: dict, strict: bool, where: str) -> None:
    """A 400 naming `where` if the grammar engine cannot compile the schema (the arguments of
    a required or named call are generated under it)."""
    import llguidance

    from ..generation.grammar import llguidance_grammar
    from ..generation.parameters import SamplingError
    from ..generation.structured import StructuredOutput

    try:
        spec = StructuredOutput.from_dict({"json_schema": schema, "strict": strict})
        error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(spec))
    except (SamplingError, ValueError, TypeError) as e:
        error = str(e)
    if error and not error.startswith("WARNING"):
        raise APIError(400, f"{where}: {error.strip().splitlines()[0][:300]}")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of its prompt, its generation and its answer."""
    tools: list[dict]
    choice: str  # none, auto, required, named
    named: str | None = None
    parallel: bool = True
    parser: str = "hermes"

    @staticmethod
    def of(body: dict, parser: str) -> "ToolPlan | None":
        """The plan of a request body (None: no tools and no tool_choice), or a 400 naming the
        field. `parser`: the served model's tool-call format (PARSERS)."""
        tools = _tools(body)
        choice = body.get("tool_choice")
        parallel = typed(body, "parallel_tool_calls", (bool,), "true or false")
        if choice is None:
            choice = "auto" if tools else "none"
        named = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            named = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(named, str):
                raise APIError(400, f"tool_choice: none, auto, required or "
                                    f'{{"type": "function", "function": {{"name": ...}}}}, not '
                                    f"{shown(choice)}")
            if named not in {t["function"]["name"] for t in tools}:
                raise APIError(400, f"tool_choice.function.name: {named!r} is not in tools")
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice: {shown(choice)}: none, auto, required or a "
                                f"named function")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice: required, with no tools")
        if not tools:
            return None
        return ToolPlan(tools, choice, named, True if parallel is None else parallel, parser)

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def structured_output(self) -> dict | None:
        """The constraint that makes the answer a call (required, named), else None."""
        if self.choice == "named":
            fn = self._function(self.named)
            return {"json_schema": fn["parameters"], "strict": bool(fn.get("strict"))}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"]["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in self.tools]
        array = {"type": "array", "minItems": 1,
                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json_schema": array, "strict": False}

    # -------------------------------------------------------------- the prompt

    def prompt(self, messages: list[dict], takes_tools: bool) -> tuple[list[dict], dict]:
        """The messages and template variables the chat template is rendered with."""
        if takes_tools:
            return [_arguments_as_objects(m) for m in messages], {"tools": self.tools}
        return _hermes_messages(messages, self.tools), {}

    # -------------------------------------------------------------- the answer

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of an answer's text."""
        if self.choice == "none":
            return text, []
        if self.choice == "named":
            return None, [ToolCall(self.named, text)]
        if self.choice == "required":
            scanner = CallArrayScanner()
            scanner.push(text)
            if not scanner.complete:  # cut short by max_tokens
                return text, []
            return None, [ToolCall(name, arguments) for name, arguments in scanner.calls]
        return parse(self.parser, text)


def _arguments_as_objects(message: dict) -> dict:
    """An assistant message's tool_calls with their arguments as objects: templates write
    them out with tojson (transformers' chat templates expect a mapping)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        out.append(c)
    return {**message, "tool_calls": out}


HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template without tools: the tools described in the system turn, calls
    as <tool_call> blocks, results as <tool_response> blocks of a user turn."""
    described = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    out = []
    if messages and messages[0].get("role") in ("system", "developer"):
        first = messages[0]
        out.append({"role": "system",
                    "content": f"{first.get('content') or ''}\n\n{described}".lstrip()})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": described})
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            blocks = []
            for c in m["tool_calls"]:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                blocks.append(f"{HERMES_OPEN}\n"
                              f"{json.dumps({'name': fn.get('name'), 'arguments': args})}\n"
                              f"{HERMES_CLOSE}")
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}"
                                                   f"\n</tool_response>"})
        else:
            out.append(m)
    return out


# ------------------------------------------------------------------ parsers

def _call_of(obj, arguments_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _json_values(text: str) -> list | None:
    """The JSON values `text` holds one after another (whitespace or `;` between), or None if
    it holds anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of text a model wrote in `parser`'s format. Text that is not a well
    formed call stays content."""
    if parser == "hermes":
        calls, kept = [], []
        pattern = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE)
                             + r"|$)", re.S)
        at = 0
        for m in pattern.finditer(text):
            values = _json_values(m.group(1))
            found = [c for v in values or [] if (c := _call_of(v)) is not None]
            if not values or len(found) != len(values):
                continue
            kept.append(text[at:m.start()])
            calls += found
            at = m.end()
        kept.append(text[at:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls
    if parser == "llama3_json":
        body = text.strip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        values = _json_values(body) if body.startswith("{") else None
        found = [c for v in values or [] if (c := _call_of(v)) is not None]
        return (None, found) if values and len(found) == len(values) else (text, [])
    if parser == "mistral":
        at = text.find(MISTRAL_CALLS)
        head, body = (text[:at], text[at + len(MISTRAL_CALLS):]) if at >= 0 else ("", text)
        if at < 0 and not text.lstrip().startswith("[{"):  # the marker decoded away
            return text, []
        values = _json_values(body.strip())
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) \
            else values
        found = [c for v in items or [] if (c := _call_of(v)) is not None]
        if items and len(found) == len(items):
            return head.strip() or None, found
        return text, []
    raise ValueError(f"tool-call parser {parser!r}: one of {', '.join(PARSERS)}")


def _marker(parser: str) -> tuple[str, ...]:
    """What a call may start with, in a streamed answer (content before it streams)."""
    return {"hermes": (HERMES_OPEN,), "llama3_json": (PYTHON_TAG, "{"),
            "mistral": (MISTRAL_CALLS, "[{")}[parser]


# ------------------------------------------------------------------ streaming

class CallArrayScanner:
    """A `required` answer, the JSON array of {"name", "arguments"} objects its grammar makes,
    read as it grows: each call's name once its string ends, then its arguments' text (as the
    model wrote it) as it comes. `push(piece)` gives what is new: ("name", index, name) and
    ("arguments", index, text) events."""

    def __init__(self):
        self.text = ""
        self.at = 0  # the next character to read
        self.depth = 0  # of objects and arrays, outside strings
        self.string_start: int | None = None  # inside a string from here
        self.escaped = False
        self.key: str | None = None  # the key of the call object's member being read
        self.expect_value = False  # after a member's colon, before its value
        self.in_value = False  # inside a call object's member value
        self.arguments_from: int | None = None  # the arguments' text starts here
        self.calls: list[list] = []  # [name, arguments' text] a call
        self.sent: list[int] = []  # of each call whose name went out: its arguments sent
        self.complete = False  # the array closed

    def push(self, piece: str) -> list[tuple]:
        self.text += piece
        while self.at < len(self.text):
            self._read(self.text[self.at])
            self.at += 1
        if self.arguments_from is not None:  # the arguments so far
            self.calls[-1][1] = self.text[self.arguments_from:self.at]
        return self._news()

    def _news(self) -> list[tuple]:
        out = []
        for i, (name, arguments) in enumerate(self.calls):
            if name is None:  # its arguments wait for it
                break
            if i == len(self.sent):
                self.sent.append(0)
                out.append(("name", i, name))
            if len(arguments) > self.sent[i]:
                out.append(("arguments", i, arguments[self.sent[i]:]))
                self.sent[i] = len(arguments)
        return out

    def _read(self, ch: str) -> None:
        if self.string_start is not None:  # inside a string: only its end matters
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self._string_ended(json.loads(self.text[self.string_start:self.at + 1]))
            return
        if self.expect_value and not ch.isspace():  # a call object's member value begins
            self.expect_value, self.in_value = False, True
            if self.key == "arguments":
                self.arguments_from = self.at
        if ch == '"':
            self.string_start = self.at
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2:  # a call begins
                self.calls.append([None, ""])
                self.key, self.in_value = None, False
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 2 and self.arguments_from is not None:  # the arguments end
                self.calls[-1][1] = self.text[self.arguments_from:self.at + 1]
                self.arguments_from, self.in_value = None, False
            elif self.depth == 0:
                self.complete = True
        elif self.depth == 2 and ch == ":":
            self.expect_value = True
        elif self.depth == 2 and ch == ",":
            self.in_value = False

    def _string_ended(self, value: str) -> None:
        self.string_start = None
        if self.depth != 2:
            return
        if not self.in_value:
            self.key = value
        elif self.key == "name":
            self.calls[-1][0] = value
            self.in_value = False


class ToolCallStream:
    """One streamed answer under a ToolPlan: `push(piece)` and `end(text)` give the deltas
    to send (each a `delta` object of a chat.completion.chunk)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""  # text not yet sent: maybe a call's start
        self.in_call = False
        self.sent_content = False
        self.named: ToolCall | None = None
        self.calls: list[ToolCall] = []
        # required: the calls' array read as it comes (names and arguments streamed)
        self.array = CallArrayScanner() if plan.choice == "required" else None

    def push(self, piece: str) -> list[dict]:
        plan = self.plan
        if plan.choice == "none":
            return [{"content": piece}] if piece else []
        if plan.choice == "named":
            out = []
            if self.named is None:
                self.named = ToolCall(plan.named, "")
                out.append({"tool_calls": [{"index": 0, **self.named.as_dict()}]})
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if self.array is not None:
            return self._array_deltas(self.array.push(piece))
        self.held += piece
        if self.in_call:
            return []
        markers = _marker(plan.parser)
        if plan.parser != "hermes":  # these formats start the answer, if anywhere
            stripped = self.held.lstrip()
            if not self.sent_content and any(m.startswith(stripped) or stripped.startswith(m)
                                             for m in markers):
                if any(stripped.startswith(m) for m in markers):
                    self.in_call = True
                return []
            return self._content(len(self.held))
        at = self.held.find(HERMES_OPEN)
        if at >= 0:
            self.in_call = True
            return self._content(at)
        # hold back a tail that may be the start of the marker
        return self._content(len(self.held) - partial_tag(self.held, HERMES_OPEN))

    def _array_deltas(self, events: list[tuple]) -> list[dict]:
        out = []
        for kind, i, value in events:
            if kind == "name":
                self.calls.append(ToolCall(value, ""))
                out.append({"tool_calls": [{"index": i, **self.calls[i].as_dict()}]})
            else:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": value}}]})
        return out

    def _content(self, upto: int) -> list[dict]:
        text, self.held = self.held[:upto], self.held[upto:]
        if text:
            self.sent_content = True
            return [{"content": text}]
        return []

    def end(self, text: str) -> list[dict]:
        """The deltas when the answer ends; `text`: the whole answer."""
        plan = self.plan
        if plan.choice in ("none", "named"):
            return []
        if self.array is not None:  # sent as it came; what the calls are, by their ids
            if not self.calls:  # cut short before a call's name: the text as content
                return [{"content": text}] if text else []
            self.calls = [ToolCall(c.name, arguments, c.id)
                          for c, (_, arguments) in zip(self.calls, self.array.calls)]
            return []
        content, self.calls = plan.calls(text)
        if not self.calls:
            held, self.held = self.held, ""
            return [{"content": held}] if held else []
        out = []
        if content and not self.sent_content:
            out.append({"content": content})
        for i, call in enumerate(self.calls):
            out.append({"tool_calls": [{"index": i, **ToolCall(call.name, "", call.id)
                                        .as_dict()}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return out

    @property
    def called(self) -> bool:
        return self.named is not None or bool(self.calls)


__all__ = ["CallArrayScanner", "PARSERS", "ToolCall", "ToolCallStream", "ToolPlan", "parse", "parser_for_template"]

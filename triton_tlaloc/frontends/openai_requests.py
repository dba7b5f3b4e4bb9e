"""What `tlaloc openai` makes of a request body: the generate model's prompt ids and sampling
parameters (`GenerateCall`), every field checked by name (a 400 naming it otherwise).

- /v1/completions: the prompt (text or token ids), max_tokens 16 by default.
- /v1/chat/completions: the messages (text content, the template's roles) rendered with the
  artifact's chat template, with the request's tools (tool_calls.py) where it has them;
  max_tokens by default what the largest context leaves.
- Both: OpenAI's sampling fields, stop strings, response_format and the extensions (vLLM's
  cache_salt and guided_* fields, this server's structured_output and speculative), passed on
  as sent once they have the JSON type their parameter takes: the generate model checks their
  ranges and names what it refuses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .http_doors import APIError, number, shown, typed
from . import reasoning
from .tokenizer import ArtifactTokenizer, LiteralContentError
from .tool_calls import PARSERS, ToolPlan, parser_for_template

log = logging.getLogger("triton_tlaloc.openai")

MAX_PROMPT_CHARS = 1_000_000  # a prompt, or the messages' content, over it is a 400


@dataclass
class ServedModel:
    name: str  # the name clients use: the sequence model's
    generate_model: str
    tokenizer: ArtifactTokenizer  # or anything with encode(text) and apply_chat_template
    max_context: int
    tool_parser: str = "auto"  # the format its model writes tool calls in (tool_calls.PARSERS)
    # How its model's answer holds its reasoning (reasoning.PARSERS; None: it holds none)
    reasoning_parser: str | None = "auto"
    # A LoRA adapter of the model `parent` served under its own name (vLLM's convention): its
    # generations carry the sampling parameter lora
    lora: str | None = None
    parent: str | None = None
    # The model's vocabulary (its generate model's parameter vocab; None: a repository written
    # before it was one): the ids a prompt may hold, which may be more than its tokenizer's
    model_vocab: int | None = None

    def __post_init__(self):
        template = getattr(self.tokenizer, "chat_template", None)
        if self.tool_parser == "auto":
            self.tool_parser = parser_for_template(template)
        if self.tool_parser not in PARSERS:
            raise ValueError(f"tool-call parser {self.tool_parser!r}: one of auto, "
                             f"{', '.join(PARSERS)}")
        if self.reasoning_parser == "auto":
            self.reasoning_parser = reasoning.parser_for_template(template)
        elif self.reasoning_parser == "none":
            self.reasoning_parser = None
        if self.reasoning_parser not in (None, *reasoning.PARSERS):
            raise ValueError(f"reasoning parser {self.reasoning_parser!r}: one of auto, none, "
                             f"{', '.join(reasoning.PARSERS)}")

    @staticmethod
    def discover(url: str, name: str, tokenizer_dir: str | None = None,
                 tool_parser: str = "auto", reasoning_parser: str = "auto") -> "ServedModel":
        """NAME as served at `url` (gRPC): its generate model NAME_generate, whose parameters
        give the tokenizer's directory (unless tokenizer_dir is given) and the largest context."""
        from .client import TlalocClient
        from ..repository import generate_model_name

        gen = generate_model_name(name)
        with TlalocClient(url, gen, "grpc") as c:
            params = c.model_parameters()
        directory = tokenizer_dir or params.get("tokenizer_dir")
        if not directory:
            raise ValueError(f"{gen} names no tokenizer directory: pass --tokenizer")
        return ServedModel(name, gen, ArtifactTokenizer(Path(directory)),
                           int(params["max_context"]), tool_parser, reasoning_parser,
                           model_vocab=int(params["vocab"]) if params.get("vocab") else None)

    @property
    def vocab(self) -> int | None:
        """How many token ids a request may name: the model's vocabulary, which is often
        padded past its tokenizer's; the tokenizer's where the model's is not known (None:
        neither says)."""
        return self.model_vocab or getattr(self.tokenizer, "vocab_size", None)

    def adapter(self, name: str) -> "ServedModel":
        """This model with its LoRA adapter `name`, served as the model `name`."""
        return dataclasses.replace(self, name=name, lora=name, parent=self.name)

    @staticmethod
    def discover_with_adapters(url: str, name: str, **kw) -> dict[str, "ServedModel"]:
        """NAME as `discover` finds it, and each LoRA adapter its sequence model serves
        (lora_adapters) as a model of its own name; an adapter named as another model is
        refused."""
        from .client import TlalocClient
        from ..lora.registry import parse_adapters

        base = ServedModel.discover(url, name, **kw)
        with TlalocClient(url, name, "grpc") as c:
            adapters = parse_adapters(c.model_parameters().get("lora_adapters", ""))
        if name in adapters:
            raise ValueError(f"model {name}: an adapter of the same name")
        return {name: base, **{a: base.adapter(a) for a in adapters}}


def _adapter(model: ServedModel) -> dict:
    """An adapter model's generations run its base model with the adapter."""
    return {"lora": model.lora} if model.lora else {}


def _sampling(body: dict, vocab: int | None = None) -> dict:
    """The generate model's sampling_parameters from an OpenAI request body. Each value is
    passed on as sent once it has the JSON type its parameter takes: the generate model checks
    its range, and names it when it refuses (a 400); token ids are checked here against the
    tokenizer's vocabulary of `vocab` ids."""
    out = {"temperature": number(body, "temperature", 1.0), "top_p": number(body, "top_p", 1.0)}
    max_tokens = number(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = number(body, "max_tokens")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for key in ("seed", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "min_p", "min_tokens"):
        if (value := number(body, key)) is not None:
            out[key] = value
    if (bias := typed(body, "logit_bias", (dict,), "an object of token id: bias")) is not None:
        out["logit_bias"] = bias
    if (asked := _logprobs(body)) is not None:
        out["logprobs"] = asked
    # vLLM's extension: each prompt token's log-probability and the most likely there
    if (top := typed(body, "prompt_logprobs", (int,), "an integer")) is not None:
        if isinstance(top, bool) or not 0 <= top <= 20:
            raise APIError(400, f"prompt_logprobs: {top}: from 0 to 20")
        out["prompt_logprobs"] = top
    # vLLM's extension: the end-of-sequence tokens do not end the generation
    if (ignore := typed(body, "ignore_eos", (bool,), "true or false")) is not None:
        out["ignore_eos"] = ignore
    # vLLM's extension: special tokens kept in the text
    if (skip := typed(body, "skip_special_tokens", (bool,), "true or false")) is not None:
        out["skip_special_tokens"] = skip
    if (user := typed(body, "user", (str,), "a string")) is not None:
        log.info("a request for user %s", shown(user[:64]))
    stop = typed(body, "stop", (str, list), "a string or a list of strings")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop: a string or a list of strings, not {shown(stop)}")
    # Refused in both forms, as vLLM refuses them: an empty stop string would match at once,
    # which no client means (to stop at nothing, leave stop out).
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise APIError(400, "stop: an empty stop string (leave stop out for none)")
    if stop:
        out["stop"] = stop
    # vLLM's extension: token ids that end the generation (not part of its text)
    if (stop_ids := _stop_token_ids(body, vocab)) is not None:
        out["stop_token_ids"] = stop_ids
    # vLLM's extension: prompts of different salts never share cached KV.
    if (salt := typed(body, "cache_salt", (str,), "a string")) is not None:
        out["cache_salt"] = salt
    # This server's extension: drafts verified in one call, e.g. {"method": "prompt_lookup",
    # "num_draft_tokens": 6} (checked by the generate model).
    if (speculative := typed(body, "speculative", (dict,), "a JSON object")) is not None:
        out["speculative"] = speculative
    if (structured := _structured_output(body)) is not None:
        out["structured_output"] = structured
    return out


def _logprobs(body: dict) -> int | None:
    """The most likely tokens to give beside each chosen one's log-probability: a chat's
    logprobs (true) and top_logprobs (0-20), a completion's logprobs (0-20); None: none."""
    given = body.get("logprobs")
    if isinstance(given, bool) or given is None:  # a chat's
        top = typed(body, "top_logprobs", (int,), "an integer")
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs: {top}: from 0 to 20")
        if top and not given:
            raise APIError(400, "top_logprobs: only with logprobs true")
        return (top or 0) if given else None
    n = typed(body, "logprobs", (int,), "true or false, or an integer")
    if not 0 <= n <= 20:
        raise APIError(400, f"logprobs: {n}: from 0 to 20")
    return n


# vLLM's older extension fields, each the structured_output kind it names.
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_output(body: dict) -> dict | None:
    """The structured_output sampling parameter a request asks for: OpenAI's
    response_format (json_object, json_schema), this server's structured_output extension or
    vLLM's guided_* fields; at most one of them. Their contents are checked by the generate
    model and the grammar compiler, which name what they refuse (a 400)."""
    asked = {}
    fmt = typed(body, "response_format", (dict,), "an object")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = typed(fmt, "json_schema", (dict,), "an object with name and schema",
                         "response_format.")
            if spec is None:
                raise APIError(400, "response_format.json_schema: required with type "
                                    "json_schema")
            schema = typed(spec, "schema", (dict,), "a JSON schema object",
                           "response_format.json_schema.")
            strict = typed(spec, "strict", (bool,), "true or false",
                           "response_format.json_schema.")
            # OpenAI's strict: every keyword enforced, or the request refused; not strict,
            # keywords the grammar engine lacks are left out.
            asked["response_format"] = {"json_schema": schema if schema is not None else {},
                                        "strict": bool(strict)}
        elif kind != "text":
            raise APIError(400, f"response_format.type: {shown(kind)} is not supported: one of "
                                f"text, json_object, json_schema")
    given = typed(body, "structured_output", (dict,), "a JSON object")
    if given is not None:
        asked["structured_output"] = given
    for field, kind in GUIDED_FIELDS.items():
        if (value := body.get(field)) is not None:
            if field == "guided_json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise APIError(400, "guided_json: not a JSON schema") from None
            asked[field] = {kind: value}
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)}: at most one constraint per request")
    return next(iter(asked.values()), None)


@dataclass
class GenerateCall:
    """One OpenAI request as the arguments of one request to its model's generate model."""
    model: ServedModel
    prompt_ids: list[int]
    sampling: dict
    stream: bool
    chat: bool  # /v1/chat/completions (else /v1/completions): the shape of the response
    include_usage: bool  # stream_options.include_usage: the last chunk carries the usage
    tools: ToolPlan | None = None  # a chat's tools: how its answer is read back
    reasoning: str | None = None  # a chat's reasoning parser (reasoning.py)
    n: int = 1  # choices: generations of the same prompt, each its own seed
    echo: str | None = None  # a completion's prompt text, given back before each choice's
    prompt_top: int | None = None  # prompt_logprobs as the client asked (echo may ask too)
    # vLLM's return_token_ids: the prompt's and each choice's token ids beside the text
    token_ids: bool = False

    def choice_sampling(self, i: int) -> dict:
        """Choice i's sampling parameters: a given seed advanced by i (each choice its own
        draws; greedy choices are the same). Only choice 0 computes the prompt's
        log-probabilities: the others share them (and its prompt's KV)."""
        if i == 0:
            return self.sampling
        sampling = {k: v for k, v in self.sampling.items() if k != "prompt_logprobs"}
        if sampling.get("seed") is not None:
            sampling["seed"] = (sampling["seed"] + i) % 2**64
        return sampling


MAX_CHOICES = 16  # n


def served_model(models: dict[str, ServedModel], body: dict) -> ServedModel:
    """The model a request names (404 if it is not served)."""
    name = typed(body, "model", (str,), "a model's name")
    if name not in models:
        raise APIError(404, f"model {name!r} is not served here (served: {', '.join(models)})",
                       "not_found_error")
    return models[name]


def choices_asked(body: dict) -> int:
    """n: the choices a request asks for, 1 to MAX_CHOICES."""
    n = typed(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n: {n}: from 1 to {MAX_CHOICES}")
    return n or 1


def _streaming(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a request body."""
    stream = typed(body, "stream", (bool,), "true or false")
    options = typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = typed(options, "include_usage", (bool,), "true or false", "stream_options.")
    return bool(stream), bool(include_usage)


def too_long(what: str, length: int, max_chars: int, unit: str = "characters") -> APIError:
    return APIError(400, f"{what}: {length} {unit}, over the {max_chars} this server takes")


# Token ids go to the generate model as int32.
MAX_TOKEN_ID = 2**31 - 1


def token_id_problem(ids: list[int], vocab: int | None) -> str | None:
    """What is wrong with the first id of `ids` that is no token id: negative, or past the
    vocabulary of `vocab` ids (None: past the largest id the generate model takes); None when
    every one is one."""
    top = MAX_TOKEN_ID + 1 if vocab is None else vocab
    for i, t in enumerate(ids):
        if t < 0:
            return f"token id {t} (at {i}) is negative: ids run from 0 to {top - 1}"
        if t >= top:
            where = (f"past the vocabulary of {vocab} tokens (ids 0 to {vocab - 1})"
                     if vocab is not None else f"past the largest token id, {MAX_TOKEN_ID}")
            return f"token id {t} (at {i}) is {where}"
    return None


def _stop_token_ids(body: dict, vocab: int | None) -> list[int] | None:
    """vLLM's stop_token_ids: a list of token ids (a JSON number with no fraction is one), each
    inside the vocabulary; None when absent."""
    given = typed(body, "stop_token_ids", (list,), "a list of token ids")
    if given is None:
        return None
    if not all(type(t) is int or (type(t) is float and t.is_integer()) for t in given):
        raise APIError(400, f"stop_token_ids: a list of token ids, not {shown(given)}")
    ids = [int(t) for t in given]
    if (problem := token_id_problem(ids, vocab)) is not None:
        raise APIError(400, f"stop_token_ids: {problem}")
    return ids


def completion_call(models: dict[str, ServedModel], body: dict,
                    max_prompt_chars: int = MAX_PROMPT_CHARS) -> GenerateCall:
    """POST /v1/completions: the prompt is one string or one list of token ids (either may
    come as a list of one); max_tokens defaults to 16."""
    model = served_model(models, body)
    stream, include_usage = _streaming(body)
    sampling = {"max_tokens": 16, **_sampling(body, model.vocab), **_adapter(model)}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if len(prompt) > max_prompt_chars:
            raise too_long("prompt", len(prompt), max_prompt_chars)
        ids = model.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and len(prompt) > max_prompt_chars:
        raise too_long("prompt", len(prompt), max_prompt_chars, "token ids")
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if (problem := token_id_problem(prompt, model.vocab)) is not None:
            raise APIError(400, f"prompt: {problem}")
        ids = list(prompt)
    else:
        raise APIError(400, f"prompt: one string or one list of token ids, not "
                            f"{shown(prompt)}")
    prompt_top = _prompt_logprobs(sampling, stream)
    echo = None
    if typed(body, "echo", (bool,), "true or false"):
        echo = prompt if isinstance(prompt, str) else model.tokenizer.decode(ids)
        if "logprobs" in sampling:  # the echoed tokens' are the prompt's
            if stream:
                raise APIError(400, "echo with logprobs: not with stream (the prompt's "
                                    "log-probabilities are not streamed)")
            sampling["prompt_logprobs"] = max(prompt_top or 0, sampling["logprobs"])
    return GenerateCall(model, ids, sampling, stream, False, include_usage,
                        n=choices_asked(body), echo=echo, prompt_top=prompt_top,
                        token_ids=_token_ids_asked(body))


def _token_ids_asked(body: dict) -> bool:
    return bool(typed(body, "return_token_ids", (bool,), "true or false"))


def _prompt_logprobs(sampling: dict, stream: bool) -> int | None:
    """prompt_logprobs as asked, refused with stream (as vLLM refuses it)."""
    top = sampling.get("prompt_logprobs")
    if top is not None and stream:
        raise APIError(400, "prompt_logprobs: not with stream (the prompt's log-probabilities "
                            "are not streamed)")
    return top


# The roles a chat template is given; any other would be rendered into it verbatim, a turn
# of the client's own naming.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages) -> list[dict]:
    """The request's messages as the chat template takes them: each an object with one of
    CHAT_ROLES, its content a string (its text parts joined with newlines, as vLLM joins them)
    or null. Anything else is a 400 naming the message."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages: a non-empty list, not {shown(messages)}")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise APIError(400, f"messages[{i}]: an object with role and content, not "
                            f"{shown(message)}")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise APIError(400, f"messages[{i}].role: {shown(role)} is not supported: one of "
                            f"{', '.join(CHAT_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": _text_of_parts(i, content)}
    if content is not None and not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content: a string or a list of parts, not "
                            f"{shown(content)}")
    return message


def _text_of_parts(i: int, parts: list) -> str:
    """A message's content parts, text only, as one text."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise APIError(400, f"{where}: a part object, not {shown(part)}")
        kind = part.get("type")
        if kind != "text":
            name = kind if isinstance(kind, str) else shown(kind)
            raise APIError(400, f"{where}: part type {name} is not supported: text only")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.text: a string, not {shown(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def _content_chars(messages: list[dict]) -> int:
    """The characters of the messages' content (chat_messages': strings or null)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def chat_call(models: dict[str, ServedModel], body: dict,
              max_prompt_chars: int = MAX_PROMPT_CHARS) -> GenerateCall:
    """POST /v1/chat/completions: the messages rendered with the chat template; max_tokens
    defaults to what the largest context leaves after the prompt."""
    model = served_model(models, body)
    stream, include_usage = _streaming(body)
    sampling = {**_sampling(body, model.vocab), **_adapter(model)}
    messages = chat_messages(body.get("messages"))
    if body.get("echo") not in (None, False):
        raise APIError(400, "echo: only on /v1/completions")
    prompt_top = _prompt_logprobs(sampling, stream)
    chars = _content_chars(messages)
    if chars > max_prompt_chars:
        raise too_long("messages' content", chars, max_prompt_chars)
    tools = ToolPlan.of(body, model.tool_parser)
    variables = _template_kwargs(body)
    if tools is not None:
        if (constraint := tools.structured_output()) is not None:
            if "structured_output" in sampling:
                raise APIError(400, f"tool_choice {tools.choice} and a response format: at "
                                    f"most one constraint per request")
            sampling["structured_output"] = constraint
        messages, more = tools.prompt(messages, getattr(model.tokenizer, "takes_tools", False))
        variables.update(more)
        if tools.choice == "auto" and tools.parser == "mistral":
            # Its calls start with the special token [TOOL_CALLS], which the text would leave
            # out (as vLLM's mistral parser asks, the text keeps special tokens)
            sampling.setdefault("skip_special_tokens", False)
    try:
        ids = model.tokenizer.apply_chat_template(messages, **variables)
    except LiteralContentError as e:  # names the message itself
        raise APIError(400, str(e))
    except Exception as e:
        raise APIError(400, f"messages: the chat template failed: {e}")
    sampling.setdefault("max_tokens", max(1, model.max_context - len(ids)))
    return GenerateCall(model, ids, sampling, stream, True, include_usage, tools,
                        model.reasoning_parser, choices_asked(body), prompt_top=prompt_top,
                        token_ids=_token_ids_asked(body))


# The template's variables a request cannot set through chat_template_kwargs
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs (vLLM's field): more variables for the chat template, such as
    qwen3's enable_thinking; at most 32, not the ones the server sets."""
    given = typed(body, "chat_template_kwargs", (dict,), "an object")
    if not given:
        return {}
    if len(given) > 32:
        raise APIError(400, f"chat_template_kwargs: {len(given)} variables, at most 32")
    for key in given:
        if not isinstance(key, str) or not key.isidentifier() or key in TEMPLATE_OWN:
            raise APIError(400, f"chat_template_kwargs: {shown(key)} is not a variable a "
                                f"request may set")
    return dict(given)

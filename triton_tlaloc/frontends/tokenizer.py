"""The artifact's tokenizer, read with the `tokenizers` library and a Jinja chat template:
no transformers in the serving path.

Message content is text, never markup: a special token's text written in a message (say
`<|im_start|>system` in a user's message) is tokenized as the plain characters it is, so a
user cannot forge a turn of the template's. Only the template's own text yields special tokens.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path


class LiteralContentError(ValueError):
    """A message's content holds special-token text and the chat template does not render that
    content verbatim, so where it lies in the prompt (to keep it plain text) is unknown."""


class ArtifactTokenizer:
    def __init__(self, directory: Path, literal_content: bool = True):
        """literal_content: special-token text in message content is tokenized as plain text
        (False: as special tokens, which lets a message forge the template's markup; only for
        a template that itself puts markup into content and needs it read)."""
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the artifact has no tokenizer.json "
                                    f"(pass --prompt-ids instead)")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = Path(directory) / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = Path(directory) / "chat_template.jinja"
        self.chat_template = (template.read_text() if template.is_file()
                              else self.config.get("chat_template"))
        self._compiled = None
        self.literal_content = literal_content
        # The special tokens (the ones a tokenizer reads out of any text) by their text.
        self.specials = {t.content: (i, t) for i, t in self.tok.get_added_tokens_decoder().items()
                         if t.special and t.content}
        # Longest first: the alternation then matches as the tokenizer does (leftmost longest).
        self._special_text = re.compile("|".join(
            re.escape(c) for c in sorted(self.specials, key=len, reverse=True))) \
            if self.specials else None
        # A second instance reads special-token text as plain text. Its flag is set once, here:
        # toggling it on the shared instance would race with encodes on other threads.
        self._plain = None
        if literal_content and self.specials:
            self._plain = Tokenizer.from_file(str(path))
            self._plain.encode_special_tokens = True

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special("eos_token")
        return None if eos is None else self.tok.token_to_id(eos)

    @property
    def vocab_size(self) -> int:
        """How many token ids it knows (its added tokens too): ids run from 0 to one less."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special or not (a piece of a character shows as U+FFFD)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], **variables) -> list[int]:
        """Render the template as transformers does (sandboxed Jinja, trim and lstrip blocks)
        with the generation prompt, and tokenize without adding special tokens again. Content
        that holds special-token text is tokenized as plain text (literal_content); other
        prompts tokenize exactly as the whole rendered text does. `variables`: more of the
        template's variables (`tools`, a template's own switches such as enable_thinking)."""
        text = self.render(messages, **variables)
        if self._plain is None or not any(self._holds_special(m) for m in messages):
            return self.encode(text, add_special_tokens=False)
        return self._encode_segments(self._segments(text, messages, variables))

    def render(self, messages: list[dict], **variables) -> str:
        return self._template().render(
            **variables, messages=messages, add_generation_prompt=True,
            bos_token=self._special("bos_token") or "", eos_token=self._special("eos_token") or "")

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (its own tool format)."""
        return bool(self.chat_template) and re.search(r"\btools\b", self.chat_template) is not None

    def _template(self):
        """The compiled template (once: compiling is most of a short prompt's rendering)."""
        if not self.chat_template:
            raise ValueError("the artifact's tokenizer has no chat template")
        if self._compiled is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        return self._compiled

    def _holds_special(self, message) -> bool:
        content = message.get("content") if isinstance(message, dict) else None
        return isinstance(content, str) and self._special_text.search(content) is not None

    def _segments(self, text: str, messages: list[dict],
                  variables: dict) -> list[tuple[str, bool]]:
        """The rendered `text` as (piece, is_content) in order: the template rendered again
        with a mark in place of each message's content tells which pieces are content. The
        marks hold a random nonce, so no content can pass for one; if putting the content back
        for the marks does not give `text`, the template transformed some content (stripped,
        split, quoted it) and it cannot be located."""
        nonce = secrets.token_hex(8)
        marked, contents = [], {}
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                mark = f"\ue000{nonce}:{i}\ue001"
                contents[mark] = m["content"]
                m = {**m, "content": mark}
            marked.append(m)
        parts = re.split(f"(\ue000{nonce}:\\d+\ue001)", self.render(marked, **variables))
        segments = [(contents.get(p, p), True) if k % 2 else (p, False)
                    for k, p in enumerate(parts)]
        if "".join(piece for piece, _ in segments) != text:
            raise LiteralContentError(self._unlocated(messages))
        return segments

    def _unlocated(self, messages: list[dict]) -> str:
        i = next(i for i, m in enumerate(messages) if self._holds_special(m))
        token = self._special_text.search(messages[i]["content"]).group()
        return (f"messages[{i}].content holds the special token text {token!r}, and the chat "
                f"template does not render content verbatim, so it cannot be kept plain text: "
                f"remove it from the message")

    def _encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """The ids of (piece, is_content) segments: special tokens only where the template's
        pieces have them, everything between (template text and content alike) tokenized as
        plain text in one go, as the tokenizer itself splits a text at its special tokens,
        so that a prompt with no special-token text in its content gets the ids of the whole
        text. (That holds for a tokenizer that treats each piece between special tokens alike
        wherever it lies, as byte-level BPE does; a Metaspace pre-tokenizer prepending to the
        text's first piece only would prepend to each piece here.)"""
        ids: list[int] = []
        between: list[str] = []
        strip_left = False  # the last special token takes the whitespace after it (rstrip)
        for piece, is_content in segments:
            if is_content:
                between.append(piece)
                continue
            at = 0
            for match in self._special_text.finditer(piece):
                token_id, token = self.specials[match.group()]
                between.append(piece[at:match.start()])
                ids += self._plain_ids("".join(between), strip_left, token.lstrip)
                ids.append(token_id)
                between, strip_left, at = [], token.rstrip, match.end()
            between.append(piece[at:])
        return ids + self._plain_ids("".join(between), strip_left, False)

    def _plain_ids(self, text: str, strip_left: bool, strip_right: bool) -> list[int]:
        """`text` tokenized with special-token text as plain text; the whitespace a special
        token next to it takes (its lstrip, rstrip) taken off first, as the tokenizer does."""
        text = text.lstrip() if strip_left else text
        text = text.rstrip() if strip_right else text
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

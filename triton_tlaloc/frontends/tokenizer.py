"""The artifact's tokenizer, read with the `tokenizers` library and a Jinja chat template:
no transformers in the serving path."""

from __future__ import annotations

import json
from pathlib import Path


class ArtifactTokenizer:
    def __init__(self, directory: Path):
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

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special("eos_token")
        return None if eos is None else self.tok.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Render the template as transformers does (sandboxed Jinja, trim and lstrip blocks)
        with the generation prompt, and tokenize without adding special tokens again."""
        if not self.chat_template:
            raise ValueError("the artifact's tokenizer has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self._special("bos_token") or "", eos_token=self._special("eos_token") or "")
        return self.encode(text, add_special_tokens=False)

"""The `structured_output` sampling parameter (docs/design.md#structured-output): a JSON
schema, any JSON object, a regular expression, a choice among strings or a Lark / GBNF grammar
that every chosen token must keep to. `StructuredOutput` checks its shape and size by name when
the request arrives; pure Python, so the generate model and the front ends check it without
llguidance. The engine that enforces it is generation/grammar.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .parameters import SamplingError, shown

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema's JSON text, a regex, the choices, a grammar
MAX_CHOICES = 1024


# Keywords that constrain nothing: a schema of these and a $ref is what its $ref names
_ANNOTATIONS = {"$ref", "$schema", "$id", "$comment", "$defs", "definitions", "title",
                "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}


def _ref_loop(schema: dict) -> str | None:
    """The $ref chain (as "'#' -> '#'") that leads from the root back to a schema on it with
    nothing but references on the way, such as {"$ref": "#"}; None when there is none (a
    $ref under a constraint, such as a property of a tree's node, is no such loop). Only
    local references ("#", "#/$defs/name") are followed."""
    seen, node, chain = ["#"], schema, []
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) \
            and set(node) <= _ANNOTATIONS:
        ref = node["$ref"]
        chain.append(repr(ref))
        if ref in seen:
            return " -> ".join(chain)
        if not ref.startswith("#"):
            return None
        seen.append(ref)
        node = schema
        for part in ref[1:].lstrip("/").split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
    return None


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint: `kind` (one of KINDS) and its source text (a schema's JSON
    text, the regex, the choices as JSON, the grammar). `strict`: a JSON schema keyword
    llguidance does not implement is refused (else ignored, as OpenAI's non-strict mode)."""

    kind: str
    text: str
    strict: bool = True

    @staticmethod
    def from_dict(d) -> "StructuredOutput | None":
        """The `structured_output` sampling parameter: None, or an object with exactly one of
        KINDS ({"json_schema": {...}, "strict": true} | {"json_object": true} |
        {"regex": "..."} | {"choice": ["a", "b"]} | {"grammar": "..."})."""
        if d is None:
            return None
        where = "sampling parameter structured_output"
        if not isinstance(d, dict):
            raise SamplingError(f"{where} {shown(d)}: expected a JSON object with one of "
                                f"{', '.join(KINDS)}")
        unknown = sorted(str(k) for k in set(d) - set(KINDS) - {"strict"})
        kinds = [k for k in KINDS if k in d]
        if unknown or len(kinds) != 1:
            raise SamplingError(f"{where}: expected exactly one of {', '.join(KINDS)}"
                                + (f" (unknown: {', '.join(unknown)})" if unknown else
                                   f" (given: {', '.join(kinds) or 'none'})"))
        kind, value = kinds[0], d[kinds[0]]
        strict = d.get("strict", True)
        if not isinstance(strict, bool):
            raise SamplingError(f"{where}.strict {shown(strict)}: expected true or false")
        if "strict" in d and kind != "json_schema":
            raise SamplingError(f"{where}.strict: only with json_schema")
        where = f"{where}.{kind}"
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise SamplingError(f"{where} {shown(value)}: expected a JSON schema object")
            if (loop := _ref_loop(value)) is not None:
                raise SamplingError(f"{where}: $ref {loop}: a recursive schema that refers only "
                                    f"to itself, with nothing to keep to (it would match any "
                                    f"JSON value): it cannot be compiled into a grammar")
            # Key order kept: llguidance writes properties in the schema's order.
            text = json.dumps(value, separators=(",", ":"))
        elif kind == "json_object":
            if value is not True:
                raise SamplingError(f"{where} {shown(value)}: expected true")
            text = '{"type":"object"}'
        elif kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise SamplingError(f"{where} {shown(value)}: expected a non-empty list of "
                                    f"non-empty strings")
            if len(value) > MAX_CHOICES:
                raise SamplingError(f"{where}: {len(value)} choices: at most {MAX_CHOICES}")
            text = json.dumps(value)
        else:  # regex, grammar
            if not isinstance(value, str) or not value:
                raise SamplingError(f"{where} {shown(value)}: expected a non-empty string")
            text = value
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise SamplingError(f"{where}: {size} bytes: at most {MAX_CONSTRAINT_BYTES}")
        return StructuredOutput(kind, text, strict)

    def as_dict(self) -> dict:
        """The parameter as a client sends it (from_dict(as_dict()) gives it back)."""
        if self.kind == "json_schema":
            return {"json_schema": json.loads(self.text), "strict": self.strict}
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind == "choice":
            return {"choice": json.loads(self.text)}
        return {self.kind: self.text}


__all__ = ["KINDS", "MAX_CHOICES", "MAX_CONSTRAINT_BYTES", "StructuredOutput"]

"""A JSON schema whose root only refers to itself ({"$ref": "#"}, or $defs referring to each
other) constrains nothing and has no grammar: refused by name when the request arrives
(generation/structured.py), not left to the grammar engine's bare stop reason."""

from __future__ import annotations

import pytest

from triton_tlaloc.generation.sampling import SamplingError
from triton_tlaloc.generation.structured import StructuredOutput

LOOPS = [
    ({"$ref": "#"}, "$ref '#': a recursive schema that refers only to itself"),
    ({"title": "t", "$ref": "#"}, "$ref '#': a recursive schema"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "$ref '#/$defs/a' -> '#/$defs/b' -> '#/$defs/a': a recursive schema"),
]
# Controls: recursion under a constraint (a tree), a $ref to a real schema, an outside $ref
FINE = [
    {"type": "object", "properties": {"child": {"$ref": "#"}}},
    {"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"},
    {"$ref": "#", "type": "object"},
    {"$ref": "https://example.com/s.json"},
]


@pytest.mark.parametrize("schema, named", LOOPS)
def test_a_schema_referring_only_to_itself_is_refused_by_name(schema, named):
    with pytest.raises(SamplingError) as e:
        StructuredOutput.from_dict({"json_schema": schema})
    assert named in str(e.value) and "cannot be compiled" in str(e.value)


@pytest.mark.parametrize("schema", FINE)
def test_recursion_under_a_constraint_is_not_a_loop(schema):
    assert StructuredOutput.from_dict({"json_schema": schema}).kind == "json_schema"

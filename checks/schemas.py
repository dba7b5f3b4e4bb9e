"""A JSON schema held out from the unit tests' (tests/unit/test_structured.py), and the chat
that asks for it: structured output checked on SmolLM2 (tests/test_generate.py,
tests/test_smollm2.py). Its strings, numbers and arrays are bounded, so every answer under it
ends within 80 tokens."""

PERSON = {  # enums, bounds, nested objects, a pattern, no extra properties
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "job": {"enum": ["baker", "pilot", "nurse", "teacher"]},
        "skills": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object",
            "properties": {"skill": {"enum": ["cooking", "flying", "singing"]},
                           "level": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["skill", "level"], "additionalProperties": False}},
    },
    "required": ["name", "age", "job", "skills"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Invent a person. Answer in JSON."}]

"""`qwen3_coder` parameter values as JSON by their schemas (parsers/parameter_values.py)."""

from __future__ import annotations

from typing import Any

import pytest

from nanoserve.parsers.parameter_values import parameter_schemas, value_json

NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}


@pytest.mark.parametrize(("schema", "text", "expected"), [
    ({"type": "string"}, "3", '"3"'),
    ({"type": "string"}, "null", '"null"'),
    ({"type": "string"}, 'café "quoted"\n', '"café \\"quoted\\"\\n"'),
    ({"type": "string", "enum": ["a", "b"]}, "a", '"a"'),
    ({"type": ["string", "null"]}, "None", "null"),
    (NULLABLE_STRING, "null", "null"),
    (NULLABLE_STRING, "text", '"text"'),
    ({"type": "integer"}, "42", "42"),
    ({"type": "integer"}, "-7", "-7"),
    ({"type": "integer"}, "4.5", '"4.5"'),  # not an integer: the string
    ({"type": "integer"}, "three", '"three"'),
    ({"type": "integer"}, "None", "null"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "7", "7"),
    ({"type": "number"}, "2.5", "2.5"),
    ({"type": "number"}, "10", "10"),
    ({"type": "number"}, "1e999", '"1e999"'),  # infinite: no JSON number
    ({"type": "number"}, "nan", '"nan"'),
    ({"type": "boolean"}, "true", "true"),
    ({"type": "boolean"}, "False", "false"),  # Jinja's `| string` of False
    ({"type": "boolean"}, "yes", '"yes"'),  # vLLM: false
    ({"type": "object"}, '{"a": [1, 2]}', '{"a": [1, 2]}'),
    ({"type": "object"}, "{'a': True, 'b': None}", '{"a": true, "b": null}'),  # Python's form
    ({"type": "object"}, "{not json", '"{not json"'),
    ({"type": "object"}, "{1, 2}", '"{1, 2}"'),  # a Python set: no JSON
    ({"type": "array"}, "[1, 'x']", '[1, "x"]'),
    ({"type": "array"}, "[" * 100_000, '"' + "[" * 100_000 + '"'),  # too deep to read
    # no type known: JSON where the text is JSON
    (None, "5", "5"),
    (None, "hello", '"hello"'),
    (None, '{"a": 1}', '{"a": 1}'),
    (None, "None", "null"),
    ({"description": "no type"}, "[1, 2]", "[1, 2]"),
    ({"type": "date"}, "2025-01-01", '"2025-01-01"'),
])
def test_values_convert_by_their_schema(schema: Any, text: str, expected: str) -> None:
    assert value_json(text, schema) == expected


def test_parameter_schemas_by_function_name() -> None:
    city = {"type": "string"}
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
                 "type": "object", "properties": {"city": city}}}},
             {"type": "function", "function": {"name": "b"}},
             {"type": "function", "function": {"name": "c", "parameters": {"properties": 5}}}]
    assert parameter_schemas(tools) == {"a": {"city": city}, "b": {}, "c": {}}
    assert parameter_schemas(None) == {}

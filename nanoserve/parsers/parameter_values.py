"""The values of `qwen3_coder` tool calls' parameters as JSON, by their types in the tool schemas.

Qwen3-Coder writes each argument as bare text (`<parameter=days>\\n3\\n</parameter>`), so only the
request's tool schema tells the number 3 from the string "3". By the parameter's type, as vLLM's
parser converts it (`Qwen3CoderToolParser._convert_param_value`):

- `string`: the text.
- `integer`, `number`: the number, in Python's syntax (`int()`, else `float()`).
- `boolean`: `true` or `false`, in any case (templates that write values with Jinja's `| string`
  teach Python's `True` and `False`).
- `object`, `array`: the JSON value, or else the Python literal (`{'a': True}`: what Jinja's
  `| string` writes for a dict or a list).
- `null` or `None`, in any case: null, unless the type is a string that does not allow null.
- no type known (the tool or the parameter is not in the request, its schema has no type, or
  its type is not one of JSON Schema's): the JSON value where the text is JSON. vLLM keeps
  these strings, but for an unknown type, which it reads as a Python literal.

A text that does not convert (`days` = "three") stays a string, as in vLLM, except that vLLM
makes a `boolean` other than true or false `false`. The type is the schema's `type` (the first
one other than "null", where it lists several), else that of its `anyOf` or `oneOf` branches.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

_NULL_WORDS = ("null", "none")  # "None": what Jinja's `| string` writes for a null
# what a conversion raises when the text is not of its type (json.JSONDecodeError is a
# ValueError; RecursionError: JSON or a literal nested deeper than Python's stack)
_NOT_CONVERTED = (ValueError, TypeError, SyntaxError, RecursionError)


def parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Each function's parameter schemas (its `parameters.properties`) by the function's name,
    from a request's tools in OpenAI's form: `{"type": "function", "function": {...}}`."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool["function"]
        properties = (function.get("parameters") or {}).get("properties")
        schemas[function["name"]] = properties if isinstance(properties, Mapping) else {}
    return schemas


def value_json(text: str, schema: Any) -> str:
    """A parameter's text as JSON text, by its schema (None: not in the tool's schema); the text
    as a JSON string where it does not convert."""
    try:
        value = _typed_value(text, _schema_types(schema))
        return json.dumps(value, ensure_ascii=False, allow_nan=False)  # inf and NaN: not JSON
    except _NOT_CONVERTED:
        return json.dumps(text, ensure_ascii=False)


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a schema names: its `type` (one or a list), else its branches' types."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [name for name in declared if isinstance(name, str)]
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list):
        return [name for branch in branches for name in _schema_types(branch)]
    return []


def _typed_value(text: str, types: list[str]) -> Any:
    """The value of `text` as its first non-null type reads it; raises where it does not."""
    main = next((name for name in types if name != "null"), None)
    if text.lower() in _NULL_WORDS and (main != "string" or "null" in types):
        return None
    if main == "string":
        return text
    if main == "integer":
        return int(text)
    if main == "number":
        return _number(text)
    if main == "boolean":
        return _boolean(text)
    if main in ("object", "array"):
        return _container(text)
    return json.loads(text)


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _boolean(text: str) -> bool:
    word = text.lower()
    if word not in ("true", "false"):
        raise ValueError(f"not a boolean: {text!r}")
    return word == "true"


def _container(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text)

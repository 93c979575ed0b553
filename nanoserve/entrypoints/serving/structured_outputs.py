"""Structured outputs on /v1/chat/completions and /v1/completions: every request shape vLLM
accepts, turned into one `StructuredOutputsParams`, and the grammar checked before the request
reaches the engine, so a bad one is a 400 naming the field as the client wrote it.

- `response_format`: `{"type": "text"}` is free text; `{"type": "json_object"}` any JSON
  object; `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` the schema
  (without one, any JSON object). OpenAI's `strict` changes nothing: the grammar always holds.
- `structured_outputs` (vLLM's object): `json`, `regex`, `choice`, `grammar` (GBNF or Lark),
  `json_object`, `disable_any_whitespace`, `whitespace_pattern`, as `StructuredOutputsParams`.
- vLLM's older top-level names: `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`, and `guided_whitespace_pattern` beside `guided_json`.

Two of them at once (or one beside a tool choice that forces a grammar) is a 400: the output
cannot follow two grammars. The check runs llguidance's parser with the model's tokenizer (a
grammar may name tokens, which only that check refuses) but without compiling (0.5 ms for a
small schema, 45-55 ms for a 1,200-property one on the dev machine), on a thread so the event
loop keeps serving streams, and remembers what passed, so a repeated schema costs nothing here.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams
from nanoserve.structured.grammar import (
    GrammarError,
    GrammarTokenizer,
    check_grammar,
    content_key,
)

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_OPTION_FIELDS = ("disable_any_whitespace", "whitespace_pattern")
_UNSUPPORTED = {"structural_tag": "structural tags are not supported",
                "disable_additional_properties": "disable_additional_properties is not "
                "supported; write \"additionalProperties\": false in the schema"}
_IGNORED = ("disable_fallback", "backend")  # one backend here: there is nothing to fall back to
_MAX_CHECKED = 1024


@dataclass(frozen=True)
class StructuredRequest:
    """The request's constraint, and the client's names for its fields (for errors)."""

    params: StructuredOutputsParams
    field: str  # where the grammar came from, e.g. "response_format.json_schema.schema"
    whitespace_field: str | None = None  # where whitespace_pattern came from


class ResponseFormatFields(Protocol):
    """Where a request's constraint is read from: the neutral `chat_input.ResponseFormatInput`
    or a request body's fields (`protocol.SamplingFields`)."""

    @property
    def response_format(self) -> dict[str, Any] | None: ...
    @property
    def structured_outputs(self) -> dict[str, Any] | None: ...
    @property
    def guided_json(self) -> dict[str, Any] | str | None: ...
    @property
    def guided_regex(self) -> str | None: ...
    @property
    def guided_choice(self) -> list[str] | None: ...
    @property
    def guided_grammar(self) -> str | None: ...
    @property
    def guided_whitespace_pattern(self) -> str | None: ...


CheckKey = tuple[bool, str]  # (checked with a tokenizer, the grammar's content key)


class _CheckedGrammars:
    """Grammars that passed the check (LRU, shared by the server's requests)."""

    def __init__(self, max_size: int) -> None:
        self._keys: OrderedDict[CheckKey, None] = OrderedDict()
        self._lock = threading.Lock()
        self.max_size = max_size

    def __contains__(self, key: CheckKey) -> bool:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, key: CheckKey) -> None:
        with self._lock:
            self._keys[key] = None
            if len(self._keys) > self.max_size:
                self._keys.popitem(last=False)


_checked = _CheckedGrammars(_MAX_CHECKED)


async def structured_outputs(req: ResponseFormatFields, has_tool_grammar: bool = False,
                             tokenizer: GrammarTokenizer | None = None
                             ) -> StructuredOutputsParams | None:
    """The request's structured-output params, checked; None for free text. Raises a 400
    (APIError) naming the client's field. `has_tool_grammar`: tool_choice already forces one.
    `tokenizer`: the model's, for the check (the server always gives it)."""
    request = structured_request(req)
    if request is None:
        return None
    if has_tool_grammar:
        raise bad_request(f"{request.field} cannot be combined with tool_choice \"required\" or "
                          "a named function, which already constrain the output", request.field)
    await check_structured_request(request, tokenizer)
    return request.params


def structured_request(req: ResponseFormatFields) -> StructuredRequest | None:
    """Reads every shape; a 400 for a malformed one or for two at once."""
    found = [r for r in (_from_response_format(req.response_format),
                         _from_structured_outputs(req.structured_outputs),
                         _from_guided(req)) if r is not None]
    if len(found) > 1:
        raise bad_request(f"{found[0].field} and {found[1].field} both constrain the output; "
                          "give one", found[1].field)
    return found[0] if found else None


async def check_structured_request(request: StructuredRequest,
                                   tokenizer: GrammarTokenizer | None = None) -> None:
    """Check the grammar off the event loop; a 400 naming the client's field."""
    key = (tokenizer is not None, content_key(request.params))
    if key in _checked:
        return
    try:
        await asyncio.to_thread(check_grammar, request.params, tokenizer)
    except GrammarError as e:
        field = request.field
        if e.field.endswith(".whitespace_pattern") and request.whitespace_field is not None:
            field = request.whitespace_field
        raise bad_request(f"{field} is not valid: {e.problem}", field) from None
    _checked.add(key)


def _params(fields: dict[str, Any], field: str,
            whitespace_field: str | None = None) -> StructuredRequest:
    """StructuredOutputsParams, its own checks' messages renamed to the client's field."""
    try:
        params = StructuredOutputsParams(**fields)
    except ValueError as e:
        message = str(e)
        for kind in (*STRUCTURED_OUTPUT_KINDS, *_OPTION_FIELDS):
            if message.startswith(f"structured_outputs.{kind} "):
                is_option = kind in _OPTION_FIELDS
                named = (whitespace_field or field) if is_option else field
                raise bad_request(named + message[len(f"structured_outputs.{kind}"):],
                                  named) from None
        raise bad_request(message, field) from None
    return StructuredRequest(params, field, whitespace_field)


def _from_response_format(response_format: dict[str, Any] | None) -> StructuredRequest | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params({"json_object": True}, "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or "
                          f"'json_schema', got {kind!r}", "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with 'name' and "
                          "'schema', given when type is 'json_schema'",
                          "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string",
                          "response_format.json_schema.name")
    if not isinstance(spec.get("strict", False), bool | None):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return _params({"json_object": True}, "response_format.json_schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object, "
                          f"got {type(schema).__name__}", "response_format.json_schema.schema")
    return _params({"json": schema}, "response_format.json_schema.schema")


def _from_structured_outputs(fields: dict[str, Any] | None) -> StructuredRequest | None:
    if fields is None:
        return None
    for name, problem in _UNSUPPORTED.items():
        if fields.get(name) is not None:
            raise bad_request(f"structured_outputs.{name}: {problem}",
                              f"structured_outputs.{name}")
    known = (*STRUCTURED_OUTPUT_KINDS, *_OPTION_FIELDS, *_IGNORED)
    unknown = sorted(set(fields) - set(known) - set(_UNSUPPORTED))
    if unknown:
        raise bad_request(f"structured_outputs has no field {unknown[0]!r}; it takes "
                          + ", ".join(STRUCTURED_OUTPUT_KINDS + _OPTION_FIELDS),
                          f"structured_outputs.{unknown[0]}")
    given = {k: v for k, v in fields.items() if k not in _IGNORED and v is not None}
    if not isinstance(given.get("disable_any_whitespace", False), bool):
        raise bad_request("structured_outputs.disable_any_whitespace must be a boolean",
                          "structured_outputs.disable_any_whitespace")
    kinds = [k for k in STRUCTURED_OUTPUT_KINDS if k in given and given[k] is not False]
    field = f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs"
    return _params(given, field, "structured_outputs.whitespace_pattern")


def _from_guided(req: ResponseFormatFields) -> StructuredRequest | None:
    given = {name: getattr(req, name) for name in _GUIDED_FIELDS
             if getattr(req, name) is not None}
    pattern = req.guided_whitespace_pattern
    if not given:
        if pattern is not None:
            raise bad_request("guided_whitespace_pattern applies to guided_json only",
                              "guided_whitespace_pattern")
        return None
    if len(given) > 1:
        first, second = list(given)[:2]
        raise bad_request(f"{first} and {second} both constrain the output; give one", second)
    (name, value), = given.items()
    fields: dict[str, Any] = {_GUIDED_FIELDS[name]: value}
    if pattern is not None:
        if name != "guided_json":
            raise bad_request("guided_whitespace_pattern applies to guided_json only",
                              "guided_whitespace_pattern")
        fields["whitespace_pattern"] = pattern
    return _params(fields, name, "guided_whitespace_pattern")

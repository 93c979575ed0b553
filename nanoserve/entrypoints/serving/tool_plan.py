"""Tool calling, the request side: what a chat input's `tools` and `tool_choice` ask of the
template, the sampler and the output parser (a `ToolPlan`), and the grammar that `required` and
a named function need. The prompt side is `chat_prompt.py`; the response side `chat_choice.py`.

Per `tool_choice` (vLLM's behaviour; absent means "auto" when tools are given, else "none"):

| tool_choice | chat template | output | finish_reason with calls |
|---|---|---|---|
| "none" | gets the tools | never parsed: all content | the engine's |
| "auto" | gets the tools | read by the tool-call parser | "tool_calls" |
| "required" | gets the tools | a grammar forces `[{"name", "parameters"}, ...]` | "tool_calls" |
| named | gets the tools | a grammar forces that function's arguments | "stop" |

"tool_calls" replaces only a natural stop: a call cut off by max_tokens keeps "length", as
OpenAI's API does (vLLM says "tool_calls" for "auto" even then). With
`parallel_tool_calls=false` the `required` grammar allows one call and "auto" keeps only the
first. The parser is `--tool-call-parser`, or else the one the chat template implies
(`parsers/tool_format.py`). The grammar goes to the engine as the request's
`SamplingParams.structured_outputs` (JSON schema, `nanoserve/structured/`); the reasoning split
does not apply to grammar-forced output, which has no reasoning section.

Where vLLM's grammar is open, this one is bounded, so that a weak model forced into it still
comes to an end (runs in docs/benchmarks.md, "Tool calling: bounds on the forced JSON"): JSON
whitespace in runs of at most 20 characters (`TOOL_JSON_WHITESPACE`); `required` items with
only `name` and `parameters`; a `required` list of at most as many calls as there are tools and
`MAX_REQUIRED_CALLS`; and a `required` list that ends at the first call repeating an earlier
one, cut there by the output processor (`output/repeats.py`, on `SamplingParams.is_call_list`)
and finishing "tool_calls", since a JSON schema cannot forbid a repeat.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.entrypoints.serving.chat_input import ChatInput, ToolInput
from nanoserve.entrypoints.serving.chat_prompt import template_tools
from nanoserve.entrypoints.serving.errors import APIError, bad_request
from nanoserve.parsers.tool_calls import TOOL_CALL_PARSERS
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured.grammar import GrammarError, check_grammar

_CHOICE_FORM = ('"none", "auto", "required" or {"type": "function", "function": '
                '{"name": "..."}}')
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_JSON_WHITESPACE = r"[ \t\n\r]{0,20}"  # between JSON tokens (see the module docstring)
MAX_REQUIRED_CALLS = 8  # calls in one `required` list, whatever the number of tools


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools ask of the template, the sampler and the output parser."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template
    function_name: str | None = None  # the named function
    structured: StructuredOutputsParams | None = None  # the grammar (required / named)
    is_parallel_allowed: bool = True

    def finish_reason(self, has_calls: bool, engine_reason: str | None) -> str | None:
        if has_calls and engine_reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def plan_tools(chat: ChatInput, tool_call_parser: str | None) -> ToolPlan:
    """Checks `tools` and `tool_choice` (400s that name the field) and plans the request."""
    tools, choice = chat.tools, chat.tool_choice
    if tools is not None and not tools:
        raise bad_request("tools must not be an empty array", "tools")
    names = _tool_names(tools or [])
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none", template_tools(tools))
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise bad_request(f"tool_choice must be {_CHOICE_FORM}, got {choice!r}", "tool_choice")
    if not tools:
        raise bad_request("when using tool_choice, tools must be set", "tool_choice")
    parallel = chat.is_parallel_tool_calls
    if choice == "auto":
        if tool_call_parser is None:  # only where a caller builds a context without one
            raise bad_request(
                '"auto" tool choice needs a tool-call parser (--tool-call-parser, one of '
                f"{', '.join(TOOL_CALL_PARSERS)})", "tool_choice")
        return ToolPlan("auto", template_tools(tools), is_parallel_allowed=parallel)
    if choice == "required":
        try:
            structured = _checked(required_schema(tools, parallel), "tools")
        except APIError:  # name the tool at fault, if one is on its own
            for i, tool in enumerate(tools):
                _checked(tool.function.parameters or _EMPTY_PARAMETERS,
                         f"tools.{i}.function.parameters")
            raise
        return ToolPlan("required", template_tools(tools), structured=structured,
                        is_parallel_allowed=parallel)
    assert isinstance(choice, dict)  # every other form was answered above
    name = _named_function(choice)
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"(there: {', '.join(names)})", "tool_choice")
    index = names.index(name)
    schema = tools[index].function.parameters or _EMPTY_PARAMETERS
    return ToolPlan("named", template_tools(tools), function_name=name,
                    structured=_checked(schema, f"tools.{index}.function.parameters"))


def _tool_names(tools: Sequence[ToolInput]) -> list[str]:
    names: list[str] = []
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            raise bad_request(f"tool names must be unique; {tool.function.name!r} is given "
                              "twice", f"tools.{i}.function.name")
        names.append(tool.function.name)
    return names


def _named_function(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise bad_request(f"tool_choice must be {_CHOICE_FORM}, got {json.dumps(choice)}",
                          "tool_choice")
    return name


def required_schema(tools: Sequence[ToolInput],
                    is_parallel_allowed: bool = True) -> dict[str, Any]:
    """vLLM's schema for `tool_choice="required"`: an array of at least one
    `{"name": <a tool's name>, "parameters": <that tool's schema>}`, one `anyOf` branch per
    tool (closed to other keys, unlike vLLM's); at most as many items as tools (and at most
    `MAX_REQUIRED_CALLS`), one without parallel calls. Each
    tool's `$defs` move to the top, where its `#/$defs/...` references then point (two tools
    may not define one name differently)."""
    branches: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(f"$defs.{name} is defined differently by two tools; with "
                                  'tool_choice="required" their $defs are shared',
                                  f"tools.{i}.function.parameters")
        branches.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "maxItems": min(len(branches), MAX_REQUIRED_CALLS),
                              "items": {"type": "object", "anyOf": branches}}
    if not is_parallel_allowed:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _checked(schema: dict[str, Any], field: str) -> StructuredOutputsParams:
    """The grammar params, refused here (400 naming the tool field) if the schema cannot
    compile, rather than in the engine under a field the client never sent."""
    params = StructuredOutputsParams(json=schema, whitespace_pattern=TOOL_JSON_WHITESPACE)
    try:
        check_grammar(params)
    except GrammarError as e:
        raise bad_request(f"the tool's parameters are not a usable JSON schema: {e.problem}",
                          field) from None
    return params

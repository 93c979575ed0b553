"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` ask for, the grammar
that `required` and a named function need, and one sample's text as OpenAI message fields.

Per `tool_choice` (vLLM's behaviour; absent means "auto" when tools are given, else "none"):

| tool_choice | chat template | output | finish_reason with calls |
|---|---|---|---|
| "none" | gets the tools | never parsed: all content | the engine's |
| "auto" | gets the tools | read by `--tool-call-parser` (400 without one) | "tool_calls" |
| "required" | gets the tools | a grammar forces `[{"name", "parameters"}, ...]` | "tool_calls" |
| named | gets the tools | a grammar forces that function's arguments | "stop" |

"tool_calls" replaces only a natural stop: a call cut off by max_tokens keeps "length", as
OpenAI's API does, so a client knows the arguments are incomplete (vLLM says "tool_calls" for
"auto" even then). With `parallel_tool_calls=false` the `required` grammar allows one call and
"auto" keeps only the first. The grammar goes to the engine as the request's
`SamplingParams.structured_outputs` (JSON schema, `nanoserve/structured/`); the
reasoning split does not apply to grammar-forced output, which has no reasoning section.

Two choices differ from vLLM's, both measured on the tests' tiny random-weight Llama, a
stand-in for a weak model that the grammar must still bring to an end (prompt "hi"; greedy and
4 seeds at temperature 1; `required` and two named functions: 15 runs of up to 100 tokens):
- Whitespace between JSON tokens is bounded to 20 characters (`TOOL_JSON_WHITESPACE`), where
  vLLM allows any amount. Unbounded, 13 of the 15 runs wrote whitespace until the token limit;
  bounded, 13 ended within 100 tokens and the two others (several `required` calls) within 300.
  20 characters still allow the usual `": "` and pretty-printing a few levels deep.
- Each `required` item allows only `name` and `parameters` (`additionalProperties: false`):
  with vLLM's open items, the greedy run started a third key string and never closed it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nanoserve.entrypoints.openai.errors import APIError, bad_request
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from nanoserve.parsers.reasoning import ReasoningParser
from nanoserve.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    NamedFunctionParser,
    ToolCallDelta,
    ToolCallParser,
    make_tool_call_parser,
    required_calls_parser,
)
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured.grammar import GrammarError, check_grammar

_CHOICE_FORM = ('"none", "auto", "required" or {"type": "function", "function": '
                '{"name": "..."}}')
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_JSON_WHITESPACE = r"[ \t\n\r]{0,20}"  # between JSON tokens (see the module docstring)


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


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (`apply_chat_template(..., tools=...)`)."""
    return None if tools is None else [tool.model_dump(exclude_none=True) for tool in tools]


def plan_tools(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan:
    """Checks `tools` and `tool_choice` (400s that name the field) and plans the request."""
    tools, choice = req.tools, req.tool_choice
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
    parallel = req.parallel_tool_calls
    if choice == "auto":
        if tool_call_parser is None:
            raise bad_request(
                '"auto" tool choice needs the server to be started with --tool-call-parser '
                f"(one of {', '.join(TOOL_CALL_PARSERS)}); \"required\", a named function and "
                '"none" work without it', "tool_choice")
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
    name = _named_function(choice)
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"(there: {', '.join(names)})", "tool_choice")
    index = names.index(name)
    schema = tools[index].function.parameters or _EMPTY_PARAMETERS
    return ToolPlan("named", template_tools(tools), function_name=name,
                    structured=_checked(schema, f"tools.{index}.function.parameters"))


def _tool_names(tools: list[ChatTool]) -> list[str]:
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


def required_schema(tools: list[ChatTool], is_parallel_allowed: bool = True) -> dict[str, Any]:
    """vLLM's schema for `tool_choice="required"`: an array of at least one
    `{"name": <a tool's name>, "parameters": <that tool's schema>}`, one `anyOf` branch per
    tool (closed to other keys, unlike vLLM's); at most one item without parallel calls. Each
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


def tool_message_fields(message: ChatMessage, index: int) -> dict[str, Any]:
    """An earlier turn's `tool_calls` and a tool message's `tool_call_id`, as templates read
    them: arguments as objects, not JSON text (vLLM parses them the same way)."""
    fields: dict[str, Any] = {}
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise bad_request(f"only assistant messages carry tool_calls, not {message.role!r}",
                              f"messages.{index}.tool_calls")
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as e:
                raise bad_request(f"arguments must be JSON text: {e}",
                                  f"messages.{index}.tool_calls.{j}.function.arguments") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        fields["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None:
            raise bad_request("a tool message needs tool_call_id, the id of the call it answers",
                              f"messages.{index}.tool_call_id")
        fields["tool_call_id"] = message.tool_call_id
    return fields


def tool_call_parser_for(plan: ToolPlan, parser_name: str | None) -> ToolCallParser | None:
    """A fresh parser of one sample's output for this plan (None: the output is content)."""
    if plan.mode == "auto":
        assert parser_name is not None  # plan_tools refuses "auto" without a parser
        return make_tool_call_parser(parser_name)
    if plan.mode == "required":
        return required_calls_parser()
    if plan.mode == "named":
        assert plan.function_name is not None
        return NamedFunctionParser(plan.function_name)
    return None


class ChoiceParser:
    """One sample's text as message fields: the reasoning split, then tool calls. `message()`
    reads a whole text; `deltas()` streams, one OpenAI delta per returned dict."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 is_parallel_allowed: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.is_parallel_allowed = is_parallel_allowed
        self.has_calls = False

    def message(self, text: str) -> dict[str, Any]:
        """`content` (plus `reasoning`, `reasoning_content`, `tool_calls` where parsed)."""
        fields: dict[str, Any] = {"content": text}
        if self.reasoning is not None:
            reasoning, fields["content"] = self.reasoning.parse(text)
            fields.update(reasoning=reasoning, reasoning_content=reasoning)
        if self.tools is not None:
            fields["content"], calls = self.tools.parse(fields["content"] or "")
            if not self.is_parallel_allowed:
                calls = calls[:1]
            if calls:
                self.has_calls = True
                fields["tool_calls"] = [{"id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments}}
                                        for c in calls]
        return fields

    def deltas(self, text: str, is_final: bool) -> list[dict[str, Any]]:
        """The deltas this piece of the output completes (`is_final`: and flushes)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if is_final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        events: list[str | ToolCallDelta] = [content]
        if self.tools is not None:
            events = self.tools.feed(content) + (self.tools.finish() if is_final else [])
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append({"reasoning": reasoning, "reasoning_content": reasoning})
        for event in events:
            if isinstance(event, str):
                if event and out and "tool_calls" not in out[-1]:
                    out[-1]["content"] = out[-1].get("content", "") + event
                elif event:
                    out.append({"content": event})
            elif self.is_parallel_allowed or event.index == 0:
                self._add_call_delta(out, event)
        return out

    def _add_call_delta(self, out: list[dict[str, Any]], event: ToolCallDelta) -> None:
        if event.name is not None:  # the call's first delta: its id and name
            self.has_calls = True
            out.append({"tool_calls": [{"index": event.index, "id": event.id,
                                        "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
        if not event.arguments:
            return
        last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
        if last is not None and last["index"] == event.index and "id" not in last:
            last["function"]["arguments"] += event.arguments
        else:
            out.append({"tool_calls": [{"index": event.index,
                                        "function": {"arguments": event.arguments}}]})

"""Tool calling and reasoning, the response side: one sample's text as OpenAI chat message
fields, whole or as streamed deltas, formatted from the neutral events of a `ChatStreamParser`
(`nanoserve/parsers/chat_stream.py`); and the parsers each sample of a request gets."""

from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.serving.chat_input import ChatInput
from nanoserve.entrypoints.serving.reasoning_options import reasoning_start
from nanoserve.entrypoints.serving.tool_plan import ToolPlan
from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
)
from nanoserve.parsers.harmony import HarmonyParser, is_harmony_parser
from nanoserve.parsers.reasoning import ReasoningParser, make_reasoning_parser
from nanoserve.parsers.tool_calls import (
    NamedFunctionParser,
    ToolCallParser,
    make_tool_call_parser,
    required_calls_parser,
)
from nanoserve.reasoning_section import INSIDE


class ChoiceParser:
    """One sample's text as message fields: the reasoning split, then tool calls. `message()`
    reads a whole text; `deltas()` streams, one OpenAI delta per returned dict."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 is_parallel_allowed: bool = True) -> None:
        self.parser = ChatStreamParser(reasoning, tools, is_parallel_allowed)
        self.has_calls = False

    def message(self, text: str) -> dict[str, Any]:
        """`content` (plus `reasoning`, `reasoning_content`, `tool_calls` where parsed)."""
        parsed = self.parser.parse(text)
        fields: dict[str, Any] = {"content": parsed.content}
        if self.parser.splits_reasoning:
            fields.update(reasoning=parsed.reasoning, reasoning_content=parsed.reasoning)
        if parsed.tool_calls:
            self.has_calls = True
            fields["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}}
                                    for c in parsed.tool_calls]
        return fields

    def deltas(self, text: str, is_final: bool) -> list[dict[str, Any]]:
        """The deltas this piece of the output completes (`is_final`: and flushes)."""
        out: list[dict[str, Any]] = []
        for event in self.parser.feed(text, is_final):
            self._add(out, event)
        return out

    def _add(self, out: list[dict[str, Any]], event: ChatEvent) -> None:
        """Text joins the delta before it unless that one carries a call; a call's first
        delta (id, name) goes alone, as OpenAI's do; its arguments join its earlier ones."""
        if isinstance(event, ReasoningDelta):
            out.append({"reasoning": event.text, "reasoning_content": event.text})
        elif isinstance(event, TextDelta):
            if out and "tool_calls" not in out[-1]:
                out[-1]["content"] = out[-1].get("content", "") + event.text
            else:
                out.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            self.has_calls = True
            out.append({"tool_calls": [{"index": event.index, "id": event.id,
                                        "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallArguments):
            last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
            if last is not None and last["index"] == event.index and "id" not in last:
                last["function"]["arguments"] += event.delta
            else:
                out.append({"tool_calls": [{"index": event.index,
                                            "function": {"arguments": event.delta}}]})
        # (ToolCallEnd: OpenAI's deltas do not mark the end of a call)


def tool_call_parser_for(plan: ToolPlan, parser_name: str | None) -> ToolCallParser | None:
    """A fresh parser of one sample's output for this plan (None: the output is content)."""
    if plan.mode == "auto":
        assert parser_name is not None  # plan_tools refuses "auto" without a parser
        return make_tool_call_parser(parser_name, plan.tools)
    if plan.mode == "required":
        return required_calls_parser()
    if plan.mode == "named":
        assert plan.function_name is not None
        return NamedFunctionParser(plan.function_name)
    return None


def choice_parsers(chat: ChatInput, prompt: str, plan: ToolPlan, reasoning_parser: str | None,
                   tool_call_parser: str | None) -> list[ChoiceParser]:
    """One per sample. Grammar-forced tool output (required / named) follows the reasoning
    section too: its grammar starts where the reasoning ends (`reasoning_options.py`)."""
    start = reasoning_start(chat, prompt, reasoning_parser)
    if is_harmony_parser(reasoning_parser) or is_harmony_parser(tool_call_parser):
        # harmony: one parser reads reasoning and calls, a forced call too (harmony_grammar.py)
        names = tuple(tool["function"]["name"] for tool in plan.tools or [])
        return [ChoiceParser(None, HarmonyParser(start is not None, plan.mode != "none", names),
                             plan.is_parallel_allowed) for _ in range(chat.sampling.n)]
    return [ChoiceParser(make_reasoning_parser(reasoning_parser, start == INSIDE)
                         if start is not None and reasoning_parser else None,
                         tool_call_parser_for(plan, tool_call_parser), plan.is_parallel_allowed)
            for _ in range(chat.sampling.n)]

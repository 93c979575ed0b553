"""One sample's text as neutral events: the reasoning split first, then tool calls in the rest.

A `ChatStreamParser` chains a `ReasoningParser` (`reasoning.py`) and a `ToolCallParser`
(`tool_calls.py`), either of which may be absent, and turns what they return into the events of
`events.py`. `feed()` takes the text deltas of a stream in order (the last one with
`is_final=True`, which flushes what the parsers held back); `parse()` reads a whole text at once,
as a non-streamed response carries it. An endpoint formats either into its wire format.

- In one `feed()`, the reasoning comes first (one `ReasoningDelta`), then the content and call
  events of the text after it, in the order the tool-call parser found them.
- Without parallel calls (`is_parallel_allowed=False`) only the first call (index 0) is kept;
  text around the others is still content.
- `ToolCallEnd(i)` comes as soon as this parser knows call `i` is over: when text, reasoning or
  another call follows it, or at the end of the output. A call never has text in the middle of it.
- A tool-call parser whose format carries reasoning too (`splits_reasoning`: harmony, where a call
  may sit on the analysis channel and reasoning may follow a preamble) stands alone, with no
  reasoning parser: its reasoning pieces come out in its order, among the text and calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.parsers.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from nanoserve.parsers.harmony import HarmonyParser
from nanoserve.parsers.reasoning import ReasoningParser
from nanoserve.parsers.tool_calls import Event, ToolCall, ToolCallParser


@dataclass(frozen=True)
class ParsedMessage:
    """A whole output, parsed (see `ChatStreamParser.parse`)."""

    content: str | None  # the text as it is when nothing parses it; else None where empty
    reasoning: str | None  # None where empty, or without a reasoning parser
    tool_calls: list[ToolCall]


class ChatStreamParser:
    """Reasoning split, then tool calls, over one sample's text (see the module)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 is_parallel_allowed: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.is_parallel_allowed = is_parallel_allowed
        self._open_call: int | None = None  # the call started and not yet ended

    @property
    def splits_reasoning(self) -> bool:
        return self.reasoning is not None or (self.tools is not None
                                              and self.tools.splits_reasoning)

    def feed(self, delta: str, is_final: bool = False) -> list[ChatEvent]:
        """The events this piece of the output completes (`is_final`: and flushes)."""
        reasoning, content = "", delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta)
            if is_final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        events: list[ChatEvent] = [ReasoningDelta(reasoning)] if reasoning else []
        pieces: list[Event | ReasoningDelta] = [content]
        if self.tools is not None:
            pieces = [*self.tools.feed(content), *(self.tools.finish() if is_final else [])]
        for piece in pieces:
            self._add(piece, events)
        if is_final:
            self._end_call(events)
        return events

    def parse(self, text: str) -> ParsedMessage:
        """A whole output at once; independent of any streaming in progress on this parser."""
        content: str | None = text
        reasoning = None
        if isinstance(self.tools, HarmonyParser):  # one parser for both (see the module)
            content, reasoning, found = self.tools.parse_message(text)
            return ParsedMessage(content, reasoning,
                                 found if self.is_parallel_allowed else found[:1])
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.parse(content or "")
            if not self.is_parallel_allowed:
                calls = calls[:1]
        return ParsedMessage(content, reasoning, calls)

    def _add(self, piece: Event | ReasoningDelta, events: list[ChatEvent]) -> None:
        if isinstance(piece, ReasoningDelta):
            if piece.text:
                self._end_call(events)
                events.append(piece)
            return
        if isinstance(piece, str):
            if piece:
                self._end_call(events)
                events.append(TextDelta(piece))
            return
        if not self.is_parallel_allowed and piece.index != 0:
            return
        if piece.name is not None:  # a call's first piece: its id and name
            assert piece.id is not None  # the parsers give a call its id with its name
            self._end_call(events)
            events.append(ToolCallStart(piece.index, piece.id, piece.name))
            self._open_call = piece.index
        if piece.arguments:
            events.append(ToolCallArguments(piece.index, piece.arguments))

    def _end_call(self, events: list[ChatEvent]) -> None:
        if self._open_call is not None:
            events.append(ToolCallEnd(self._open_call))
            self._open_call = None

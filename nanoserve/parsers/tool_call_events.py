"""What every tool-call parser gives back: content text and pieces of calls, the interface they
share, and the helpers they all use (`tool_calls.py`, `xml_tool_calls.py`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass
class ToolCallDelta:
    """A piece of one streamed call (OpenAI's `delta.tool_calls[i]`)."""

    index: int  # the call's place in the message, from 0
    id: str | None = None  # with `name`, on the call's first piece only
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """A whole call, as a non-streamed message carries it."""

    id: str
    name: str
    arguments: str  # JSON text


Event = str | ToolCallDelta  # content text, or a piece of a call


def new_tool_call_id() -> str:
    """OpenAI's form: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def assemble(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """Events -> (content, None where empty; the calls in order)."""
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.name is not None:
                calls[event.index] = ToolCall(event.id or new_tool_call_id(), event.name, "")
            calls[event.index].arguments += event.arguments
    return content or None, [calls[i] for i in sorted(calls)]


class ToolCallParser:
    """The interface: one instance per sample, fed its text deltas in order."""

    # True for a format whose messages carry reasoning too (harmony): its events then hold
    # `ReasoningDelta`s beside text and call pieces, and `ChatStreamParser` needs no reasoning
    # parser before it
    splits_reasoning = False

    def feed(self, delta: str) -> list[Event]:
        """The events this piece of text completes, in order."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The end of the text: what was held back, and the end of an open call."""
        raise NotImplementedError

    def fresh(self) -> ToolCallParser:
        """A new parser of the same kind, at the start."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole text at once: (content, None where empty; the calls). Independent of any
        streaming in progress on this parser."""
        parser = self.fresh()
        return assemble(parser.feed(text) + parser.finish())


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0

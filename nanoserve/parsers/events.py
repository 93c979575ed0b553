"""The neutral events one sample's text is parsed into, in no wire format.

`ChatStreamParser` (`chat_stream.py`) emits them as the text streams in; each API endpoint
formats them into its own wire format (OpenAI's chat deltas: `entrypoints/serving/chat_choice.py`).
A call's events come in order: `ToolCallStart`, then any number of `ToolCallArguments`, then
`ToolCallEnd`; the arguments of one call add up to its JSON text, as the model wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    """A piece of the answer (content) text."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the reasoning text (what the model wrote between `<think>` tags)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call begins: its place in the message (from 0), its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A piece of call `index`'s arguments (JSON text)."""

    index: int
    delta: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call `index` has no more arguments."""

    index: int


ChatEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArguments | ToolCallEnd

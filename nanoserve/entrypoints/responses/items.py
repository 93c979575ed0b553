"""One sample's neutral parser events (`nanoserve/parsers/events.py`) as Responses output items
and the stream events that build them.

A streamed response sends the events as they come; a whole response feeds its whole text
through the same builder and keeps only the items, so the two always agree. Items, in output
order: a `reasoning` item for the reasoning text, a `message` item (one `output_text` part) for
each run of answer text, a `function_call` item for each call. Text that is only whitespace
opens no message (models write newlines between calls); it is kept when a message follows,
and given as a message at the end only if there are no calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from nanoserve.parsers.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)

Event = dict[str, Any]  # one stream event's body, before its sequence_number


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Builds `output` from events; `feed` and `finish` return the stream events."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (last of items)
        self._held_space = ""  # whitespace that has not opened a message (yet)

    @property
    def output_text(self) -> str:
        """The text of every message item (the SDK's `output_text`)."""
        return "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning"
                       for part in item["content"])

    def feed(self, events: Iterable[ChatEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                self._text("reasoning", event.text, out)
            elif isinstance(event, TextDelta):
                self._answer_text(event.text, out)
            elif isinstance(event, ToolCallStart):
                self._close(out)
                self._held_space = ""
                self._add({"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                           "call_id": event.id, "name": event.name, "arguments": ""}, out)
            elif isinstance(event, ToolCallArguments):
                item = self._open
                if item is not None and item["type"] == "function_call":
                    item["arguments"] += event.delta
                    out.append({"type": "response.function_call_arguments.delta",
                                **self._where(item), "delta": event.delta})
            elif isinstance(event, ToolCallEnd):
                self._close(out)
        return out

    def finish(self, status: str = "completed") -> list[Event]:
        """The end of the output; the item still open gets `status` ("incomplete" when the
        output was cut short)."""
        out: list[Event] = []
        if self._held_space and not any(i["type"] == "function_call" for i in self.items):
            self._text("message", self._held_space, out, is_held_space=True)
        self._close(out, status)
        return out

    def _answer_text(self, text: str, out: list[Event]) -> None:
        is_open = self._open is not None and self._open["type"] == "message"
        if not is_open and text.isspace():
            self._held_space += text
            return
        self._text("message", text, out)

    def _text(self, kind: str, text: str, out: list[Event], is_held_space: bool = False) -> None:
        """Text into the open item of `kind` (a message or reasoning), opening one if needed."""
        if self._open is None or self._open["type"] != kind:
            self._close(out)
            part: dict[str, Any]
            item: dict[str, Any]
            if kind == "message":
                text = ("" if is_held_space else self._held_space) + text
                self._held_space = ""
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress",
                        "summary": [], "content": []}
            self._add(item, out)
            item["content"].append(part)
            out.append({"type": "response.content_part.added", **self._where(item),
                        "content_index": 0, "part": dict(part)})
        assert self._open is not None
        self._open["content"][0]["text"] += text
        out.append({"type": f"response.{_TEXT_EVENTS[kind]}.delta", **self._where(self._open),
                    "content_index": 0, "delta": text,
                    **({"logprobs": []} if kind == "message" else {})})

    def _add(self, item: dict[str, Any], out: list[Event]) -> None:
        self.items.append(item)
        self._open = item
        out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                    "item": _copy(item)})

    def _close(self, out: list[Event], status: str = "completed") -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            out.append({"type": "response.function_call_arguments.done", **where,
                        "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = _TEXT_EVENTS[item["type"]]
            out.append({"type": f"response.{kind}.done", **where, "content_index": 0,
                        "text": part["text"],
                        **({"logprobs": []} if item["type"] == "message" else {})})
            out.append({"type": "response.content_part.done", **where, "content_index": 0,
                        "part": dict(part)})
        out.append({"type": "response.output_item.done", "output_index": where["output_index"],
                    "item": _copy(item)})

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        """Where an event's item is; only the open item, always the last, has events."""
        return {"item_id": item["id"], "output_index": len(self.items) - 1}


_TEXT_EVENTS = {"message": "output_text", "reasoning": "reasoning_text"}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item for an event (the builder goes on changing its own)."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item \
        else dict(item)

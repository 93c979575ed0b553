"""Harmony, gpt-oss's chat format: one sample's text as reasoning, content and tool calls.

vLLM splits harmony over two parsers (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`), both reading the same channel headers; here one `HarmonyParser` reads the messages once
and gives back both kinds of pieces: content text, `ToolCallDelta`s and `ReasoningDelta`s. A
call can sit on the `analysis` channel and reasoning can follow a preamble, so no split of the
text into "reasoning, then content" (`ChatStreamParser`'s chain) would hold; the parser takes
the tool-call slot of `ChatStreamParser`, which passes its reasoning pieces on
(`splits_reasoning`). The `openai_gptoss` reasoning parser alone is the same parser with calls
swallowed (`reasoning.HarmonyReasoningParser`).

The text is what nanoserve's detokenizer makes of the output, format tokens kept. It starts after
the prompt's `<|start|>assistant`, and holds messages
`[<|start|>ROLE][ to=R]<|channel|>CHANNEL[ to=R][ <|constrain|>TYPE| json]<|message|>BODY` each
ended by `<|end|>`, `<|call|>`, `<|return|>`, the next `<|start|>` or the end of the text
(llama.cpp's `common/parsers/gpt-oss.cpp`, vLLM's `openai_tool_parser.py`):

- `analysis` without a recipient → reasoning (dropped where the request asked for none);
  `final`, and `commentary` without a recipient (a preamble) → content, messages joined as they
  are. A header holding several `<|channel|>`s (gpt-oss-20b's stray `<|channel|>commentary
  to=assistant` before the real one) is read by its last channel; `to=assistant` is no recipient.
- A recipient `functions.NAME` (in the role part or the channel header, on any channel) → a call
  of NAME whose arguments are the body, passed on as the model wrote it (as every JSON format
  here does, `call_scanner.py` says why: streamed and whole calls are the same text); an empty
  body is `{}`. A `json` glued to the name (`to=functions.shelljson`, llama.cpp PR #15158) is cut
  off where the name without it is one of the request's tools. Without `parses_calls` (no tools
  offered) such a message is swallowed, as are built-in recipients (`browser.*`, `python`,
  `container.exec`), as llama.cpp swallows "unsolicited" calls.
- A message whose start is no header (not `<|start|>`, `<|channel|>`, ` to=` or `<|message|>`) is
  content as it stands: a model that writes plain text loses nothing.
- A text cut off keeps what it had: a body so far is its field's text (a call's arguments so
  far); a header cut off gives nothing.
- Held back while streaming: a message's header until its `<|message|>`, and in a body a tail
  that may still become a format token (at most 9 characters). Nothing else.
"""

from __future__ import annotations

import re

from nanoserve.parsers.events import ReasoningDelta
from nanoserve.parsers.tool_call_events import (
    Event,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    new_tool_call_id,
    partial_tag_length,
)

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
FORMAT_TOKENS = (START, END, MESSAGE, CHANNEL, CALL, RETURN, CONSTRAIN)
_BODY_ENDS = (END, CALL, RETURN, START)
_HEADER_STARTS = (START, CHANNEL, " to=", MESSAGE)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."

HarmonyEvent = Event | ReasoningDelta

_HEADER, _BODY = range(2)
_REASONING, _CONTENT, _CALL, _SWALLOWED = range(4)  # what a body is


class HarmonyParser(ToolCallParser):
    """Harmony messages as content, reasoning and call pieces (see the module).
    `include_reasoning`: analysis text comes out (else dropped); `parses_calls`: recipients
    `functions.*` are calls (else swallowed); `tool_names`: the request's, for a glued `json`."""

    splits_reasoning = True

    def __init__(self, include_reasoning: bool = True, parses_calls: bool = True,
                 tool_names: tuple[str, ...] = ()) -> None:
        self.include_reasoning = include_reasoning
        self.parses_calls = parses_calls
        self.tool_names = tool_names
        self._state = _HEADER
        self._kind = _CONTENT
        self._held = ""
        self._num_calls = 0
        self._call_text = ""  # the open call's arguments so far

    def fresh(self) -> HarmonyParser:
        return HarmonyParser(self.include_reasoning, self.parses_calls, self.tool_names)

    def feed(self, delta: str) -> list[HarmonyEvent]:  # type: ignore[override]
        text, self._held = self._held + delta, ""
        events: list[HarmonyEvent] = []
        while text:
            text = self._header(text, events) if self._state == _HEADER else \
                self._body(text, events)
        return events

    def finish(self) -> list[HarmonyEvent]:  # type: ignore[override]
        held, self._held = self._held, ""
        events: list[HarmonyEvent] = []
        if self._state == _BODY:  # cut off: the body so far, a partial token as text
            self._emit(held, events)
            self._end_message(events)
        self._state = _HEADER
        return events

    def parse_message(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole text at once: (content, reasoning, calls), None where empty."""
        parser = self.fresh()
        events = parser.feed(text) + parser.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        content = "".join(e for e in events if isinstance(e, str))
        calls: list[ToolCall] = []
        for event in events:
            if isinstance(event, ToolCallDelta):
                if event.name is not None:
                    calls.append(ToolCall(event.id or new_tool_call_id(), event.name, ""))
                calls[-1].arguments += event.arguments
        return content or None, reasoning or None, calls

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, _, calls = self.parse_message(text)
        return content, calls

    def _header(self, text: str, events: list[HarmonyEvent]) -> str:
        """A message's start: its header up to `<|message|>`, or plain text (content)."""
        if not text.startswith(_HEADER_STARTS):
            if any(start.startswith(text) for start in _HEADER_STARTS):
                self._held = text
                return ""
            self._state, self._kind = _BODY, _CONTENT  # no header: content as it stands
            return text
        at = text.find(MESSAGE)
        if at == -1:
            self._held = text
            return ""
        self._open_message(text[:at], events)
        return text[at + len(MESSAGE):]

    def _open_message(self, header: str, events: list[HarmonyEvent]) -> None:
        channels = _CHANNEL_NAME.findall(header)
        channel = channels[-1] if channels else "final"
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        self._state = _BODY
        if not recipients:
            self._kind = _REASONING if channel == "analysis" else _CONTENT
            return
        recipient = recipients[-1]
        if not (self.parses_calls and recipient.startswith(_FUNCTIONS)):
            self._kind = _SWALLOWED
            return
        name = recipient[len(_FUNCTIONS):]
        if name not in self.tool_names and name.endswith("json") \
                and name[:-len("json")] in self.tool_names:
            name = name[:-len("json")]
        self._kind, self._call_text = _CALL, ""
        events.append(ToolCallDelta(self._num_calls, new_tool_call_id(), name))

    def _body(self, text: str, events: list[HarmonyEvent]) -> str:
        found = [(at, token) for token in _BODY_ENDS if (at := text.find(token)) != -1]
        if not found:
            keep = len(text) - max(partial_tag_length(text, token) for token in _BODY_ENDS)
            self._emit(text[:keep], events)
            self._held = text[keep:]
            return ""
        at, token = min(found)
        self._emit(text[:at], events)
        self._end_message(events)
        self._state = _HEADER
        # `<|start|>` opens the next message's header; the others only end this one
        return text[at:] if token == START else text[at + len(token):]

    def _emit(self, text: str, events: list[HarmonyEvent]) -> None:
        if not text:
            return
        if self._kind == _CONTENT:
            events.append(text)
        elif self._kind == _REASONING:
            if self.include_reasoning:
                events.append(ReasoningDelta(text))
        elif self._kind == _CALL:
            self._call_text += text
            events.append(ToolCallDelta(self._num_calls, arguments=text))

    def _end_message(self, events: list[HarmonyEvent]) -> None:
        if self._kind == _CALL:
            if not self._call_text.strip():
                events.append(ToolCallDelta(self._num_calls, arguments="{}"))
            self._num_calls += 1
        self._kind = _CONTENT


def is_harmony_parser(name: str | None) -> bool:
    """Whether a `--reasoning-parser` or `--tool-call-parser` name is harmony's."""
    return name in ("openai_gptoss", "openai")

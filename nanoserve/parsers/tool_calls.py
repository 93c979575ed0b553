"""Tool calls in a model's text: the `--tool-call-parser` formats, streamed or whole.

`ChatStreamParser` (`chat_stream.py`) feeds one sample's text deltas to a `ToolCallParser`
(after the reasoning split, if any) and turns what it returns into neutral events
(`events.py`). It returns content text, and `ToolCallDelta`s — for each call first one with its
`id` and `name`, then fragments of its `arguments`. `finish()` flushes what was held back.
`parse()` reads a whole text at once and always equals what feeding it in any chunks and
finishing adds up to (it is that, on a fresh parser), so a streamed response and a non-streamed
one carry the same calls and content.

Formats (vLLM's parser names):

- `hermes` (Hermes 2 Pro, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, anywhere in the message. Text outside the blocks is content, verbatim, except the
  whitespace right after a call's block (so calls alone give no content; vLLM keeps only the
  text before the first block, which is the same content in the usual case). A block whose
  object has no `name` (or is not an object) is content, tags included, verbatim. After a
  call's object, the rest of its block is ignored. Held back while streaming: a partial
  `<tool_call>` in content, a partial `</tool_call>` in a block, and a block until its name is
  known.
- `llama3_json` (Llama 3.1/3.2 with JSON tool templates): the message is one JSON object
  `{"name": ..., "parameters": {...}}` (or `"arguments"`), or several separated by `;`,
  optionally after `<|python_tag|>`. A message that starts otherwise is all content; so is one
  whose first object has no name. Text after the calls is content. (vLLM's non-streamed parser
  looks for JSON anywhere in the text; its streaming one, like this one, only at the start.)
- `qwen3_coder` (Qwen3-Coder, Qwen3.5/3.6; in `xml_tool_calls.py`): `<tool_call>` blocks, each
  holding a call `<function=NAME>`, one `<parameter=KEY>VALUE</parameter>` per argument,
  `</function>`. Text outside the blocks is content as with `hermes`, and so is a block without a
  call, tags included. Several functions in one block are several calls; other text in a block, or
  between a call's parameters, is ignored. A closing tag also closes what is open inside it: a
  parameter whose `</parameter>` is missing ends at `</function>` or `</tool_call>`, a call at
  `</tool_call>`. A name holding whitespace, quotes, braces or `<` makes its tag no tag (vLLM's rule
  for function names). The arguments are built: a VALUE loses one newline at each end (the
  template's) and becomes JSON by its parameter's type in the request's tool schema
  (`parameter_values.py`); streamed, a call sends `{` as it starts, one `"KEY": value` (after `, `)
  as each parameter closes, and `}` at `</function>`. Held back while streaming: partial tags, a
  block until its first call's name is known, and each parameter until it closes. (vLLM reads
  well-formed calls the same; for malformed ones it has heuristics of its own: a missing
  `</parameter>` also ends at the next `<parameter=` line, and its non-streamed parser takes a
  `<function=` outside any block where the text has no block at all, its streaming one not.)
- `gemma4` (Gemma 4; in `gemma4_tool_calls.py`, which says the rules):
  `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,arr:[...],obj:{...}}<tool_call|>`, calls one
  after another, text outside them content. The arguments are not JSON (bare keys, strings
  between `<|"|>` tokens taken verbatim); they are made JSON text in `json.dumps`'s form as they
  stream. A call cut off keeps what it had, closed.
- `openai` (gpt-oss's harmony; in `harmony.py`, which says the rules): a message to
  `functions.NAME` is a call whose body is its JSON arguments; the same parser gives the
  `analysis` channel as reasoning (`splits_reasoning`), so it stands alone in `ChatStreamParser`.

And two forms the server uses when a grammar forces the output (`tool_choice`):
`required` — a JSON array of `{"name": ..., "parameters": {...}}`; a named function — the
whole output is that function's arguments.

In the JSON formats, arguments are passed on as the model wrote them (`call_scanner.py` says
why). A call whose object ends without arguments gets `{}`; one cut off (the output hit
max_tokens) keeps the arguments it had, as OpenAI's API does. A `qwen3_coder` call cut off keeps
the parameters it had, an open one with its value so far, and gets its closing brace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nanoserve.parsers.call_scanner import OPEN, CallObjectScanner
from nanoserve.parsers.gemma4_tool_calls import Gemma4ToolParser
from nanoserve.parsers.harmony import HarmonyParser
from nanoserve.parsers.tool_call_events import (  # the shared parts, imported from here too
    Event,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    assemble,
    new_tool_call_id,
    partial_tag_length,
)
from nanoserve.parsers.xml_tool_calls import Qwen3CoderToolParser

__all__ = ["TOOL_CALL_PARSERS", "Event", "ToolCall", "ToolCallDelta", "ToolCallParser",
           "assemble", "make_tool_call_parser", "new_tool_call_id", "required_calls_parser"]

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "gemma4", "openai")


class _Call:
    """One call being read: its header goes out once the name is known, arguments after it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = CallObjectScanner()
        self.is_started = False  # the header was sent
        self.raw = ""  # the text read while no name is known (for the not-a-call fallback)
        self._early_arguments: list[str] = []  # arguments written before the name

    @property
    def is_open(self) -> bool:
        return self.scanner.status == OPEN

    def feed(self, text: str) -> tuple[int, list[Event]]:
        """(characters consumed, the deltas they complete)."""
        consumed, arguments = self.scanner.feed(text)
        if self.is_started:
            return consumed, [ToolCallDelta(self.index, arguments=arguments)] if arguments else []
        self.raw += text[:consumed]
        self._early_arguments.append(arguments)
        if self.scanner.name is None:
            return consumed, []
        self.is_started = True
        events: list[Event] = [ToolCallDelta(self.index, new_tool_call_id(), self.scanner.name)]
        early = "".join(self._early_arguments)
        if early:
            events.append(ToolCallDelta(self.index, arguments=early))
        return consumed, events

    def close(self) -> list[Event]:
        """The call ends: one whose object had no arguments gets `{}`."""
        if self.is_started and not self.scanner.has_arguments:
            return [ToolCallDelta(self.index, arguments="{}")]
        return []


class HermesToolParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` blocks (see the module)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        self._held = ""
        self._call: _Call | None = None  # the open block's call
        self._is_fallback = False  # the open block is not a call: its text is content
        self._is_after_call = False  # whitespace here follows a call's block: dropped
        self._num_calls = 0

    def fresh(self) -> HermesToolParser:
        return HermesToolParser()

    def feed(self, delta: str) -> list[Event]:
        text, self._held = self._held + delta, ""
        events: list[Event] = []
        while text:
            text = self._content(text, events) if self._call is None else \
                self._block(text, events)
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        events: list[Event] = []
        if self._call is not None:  # a partial closing tag is block text after all
            self._block_text(held, events)
            self._close_block(events, closing_tag="")
        elif held:
            events.append(held)
        return events

    def _content(self, text: str, events: list[Event]) -> str:
        if self._is_after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._is_after_call = False
        at = text.find(self.start)
        if at == -1:
            keep = len(text) - partial_tag_length(text, self.start)
            if keep:
                events.append(text[:keep])
            self._held = text[keep:]
            return ""
        if at:
            events.append(text[:at])
        self._call = _Call(self._num_calls)
        return text[at + len(self.start):]

    def _block(self, text: str, events: list[Event]) -> str:
        at = text.find(self.end)
        if at == -1:
            keep = len(text) - partial_tag_length(text, self.end)
            self._block_text(text[:keep], events)
            self._held = text[keep:]
            return ""
        self._block_text(text[:at], events)
        self._close_block(events, closing_tag=self.end)
        return text[at + len(self.end):]

    def _block_text(self, text: str, events: list[Event]) -> None:
        call = self._call
        assert call is not None
        if self._is_fallback:
            events.append(text)
        elif call.is_open:
            consumed, deltas = call.feed(text)
            events.extend(deltas)
            if not call.is_started and not call.is_open:  # no name: the block is content
                self._is_fallback = True
                events.append(self.start + call.raw + text[consumed:])
        # else: after the call's object, the rest of its block is ignored

    def _close_block(self, events: list[Event], closing_tag: str) -> None:
        call = self._call
        assert call is not None
        if self._is_fallback:
            events.append(closing_tag)
        elif call.is_started:
            events.extend(call.close())
            self._num_calls += 1
            self._is_after_call = True
        else:  # closed before a name was known
            events.append(self.start + call.raw + closing_tag)
        self._call, self._is_fallback = None, False


_START, _BEFORE_OBJECT, _IN_CALL, _BETWEEN, _CONTENT, _ENDED = range(6)


class CallSequenceParser(ToolCallParser):
    """Call objects one after another: Llama's `{...}; {...}` after an optional tag, or the JSON
    array `[{...}, {...}]` a grammar forces for `tool_choice="required"`."""

    def __init__(self, *, tag: str = "", opening: str = "", separator: str = ";",
                 closing: str = "") -> None:
        self.tag, self.opening, self.separator, self.closing = tag, opening, separator, closing
        self._state = _START
        self._held = ""
        self._prefix = ""  # the tag and opening text read before the first call's name
        self._call: _Call | None = None
        self._num_calls = 0

    def fresh(self) -> CallSequenceParser:
        return CallSequenceParser(tag=self.tag, opening=self.opening, separator=self.separator,
                                  closing=self.closing)

    def feed(self, delta: str) -> list[Event]:
        text, self._held = self._held + delta, ""
        events: list[Event] = []
        while text:
            if self._state == _START:
                text = self._start(text)
            elif self._state == _BEFORE_OBJECT:
                body = text.lstrip()
                if not body:
                    self._prefix += text
                    return events
                if body[0] == "{":
                    self._prefix += text[:len(text) - len(body)]
                    self._open_call()
                    text = body
                else:  # a tag or bracket, then no object: all content
                    text = self._to_content(self._prefix + text)
            elif self._state == _IN_CALL:
                text = self._in_call(text, events)
            elif self._state == _BETWEEN:
                text = text.lstrip(" \t\r\n" + self.separator)
                if not text:
                    break
                if self.closing and text.startswith(self.closing):
                    self._state = _ENDED
                elif text[0] == "{":
                    self._open_call()
                else:
                    self._state = _CONTENT
            elif self._state == _CONTENT:
                events.append(text)
                break
            else:  # after the closing bracket: ignored
                break
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        events: list[Event] = []
        if self._state == _START and held:
            events.append(held)
        elif self._state == _BEFORE_OBJECT:
            events.append(self._prefix)
        elif self._state == _IN_CALL and self._call is not None:
            if self._call.is_started:
                events.extend(self._call.close())
            else:
                events.append(self._prefix + self._call.raw)
        return events

    def _start(self, text: str) -> str:
        body = text.lstrip()
        for marker in (self.tag, self.opening):
            if marker and body.startswith(marker):
                self._prefix += text[:len(text) - len(body) + len(marker)]
                self._state = _BEFORE_OBJECT
                return body[len(marker):]
        if not body or (self.tag and self.tag.startswith(body)):
            self._held = text  # whitespace, or what may still become the tag
            return ""
        if body[0] == "{" and not self.opening:
            self._prefix += text[:len(text) - len(body)]
            self._open_call()
            return body
        self._state = _CONTENT
        return text

    def _open_call(self) -> None:
        self._call = _Call(self._num_calls)
        self._state = _IN_CALL

    def _to_content(self, text: str) -> str:
        self._state = _CONTENT
        self._prefix = ""
        return text

    def _in_call(self, text: str, events: list[Event]) -> str:
        call = self._call
        assert call is not None
        consumed, deltas = call.feed(text)
        events.extend(deltas)
        if call.is_started:
            self._prefix = ""
        if call.is_open:
            return ""
        rest = text[consumed:]
        if not call.is_started:  # not a call: it and what follows are content
            return self._to_content(self._prefix + call.raw + rest)
        events.extend(call.close())
        self._num_calls += 1
        self._call = None
        self._state = _BETWEEN
        return rest


class NamedFunctionParser(ToolCallParser):
    """The whole output is the arguments of one named function (a grammar forces them)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._is_started = False

    def fresh(self) -> NamedFunctionParser:
        return NamedFunctionParser(self.name)

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if not self._is_started:
            self._is_started = True
            events.append(ToolCallDelta(0, new_tool_call_id(), self.name))
        if delta:
            events.append(ToolCallDelta(0, arguments=delta))
        return events

    def finish(self) -> list[Event]:
        return self.feed("")


def make_tool_call_parser(name: str,
                          tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParser:
    """A fresh parser for one sample, by its `--tool-call-parser` name. `tools`: the request's,
    in OpenAI's form (`{"type": "function", "function": {...}}`), where `qwen3_coder` finds the
    types of its calls' arguments; the JSON formats and `gemma4` (typed values) need none."""
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return CallSequenceParser(tag="<|python_tag|>", separator=";")
    if name == "qwen3_coder":
        return Qwen3CoderToolParser(tools)
    if name == "gemma4":
        return Gemma4ToolParser()
    if name == "openai":  # harmony: reasoning and calls in one parser (harmony.py)
        names = tuple(str(t.get("function", {}).get("name", "")) for t in tools or ())
        return HarmonyParser(tool_names=names)
    raise ValueError(f"unknown tool call parser {name!r}; expected one of {TOOL_CALL_PARSERS}")


def required_calls_parser() -> ToolCallParser:
    """The JSON array `tool_choice="required"` forces: `[{"name": ..., "parameters": ...}]`."""
    return CallSequenceParser(opening="[", separator=",", closing="]")

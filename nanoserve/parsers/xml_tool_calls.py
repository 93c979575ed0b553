"""`qwen3_coder`: Qwen3-Coder's XML tool calls (the format is described in `tool_calls.py`'s
module docstring, beside the other formats)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from nanoserve.parsers.parameter_values import parameter_schemas, value_json
from nanoserve.parsers.tool_call_events import (
    Event,
    ToolCallDelta,
    ToolCallParser,
    new_tool_call_id,
    partial_tag_length,
)

_BLOCK_START, _BLOCK_END = "<tool_call>", "</tool_call>"  # hermes' blocks
_FUNCTION_START, _FUNCTION_END = "<function=", "</function>"
_PARAMETER_START, _PARAMETER_END = "<parameter=", "</parameter>"
# A function's or parameter's name runs to its tag's `>`; any other of these before it makes the
# text no tag (vLLM refuses function names holding them: `<function={{ name }}>` is no call)
_NAME_END = re.compile(r"[\s<>{}\"']")
_OUTSIDE, _IN_BLOCK, _FUNCTION_NAME, _IN_FUNCTION, _PARAMETER_NAME, _IN_PARAMETER = range(6)


class _XmlCall:
    """One `<function=NAME>` call: its arguments, a JSON object of one member per parameter."""

    def __init__(self, index: int, name: str, schemas: Mapping[str, Any]) -> None:
        self.index = index
        self.name = name
        self.schemas = schemas  # its parameters' schemas, by name
        self._num_arguments = 0

    def start(self) -> list[Event]:
        return [ToolCallDelta(self.index, new_tool_call_id(), self.name),
                ToolCallDelta(self.index, arguments="{")]

    def argument(self, key: str, value: str) -> ToolCallDelta:
        """A parameter's member, `"key": value`, after a comma unless it is the first."""
        separator = ", " if self._num_arguments else ""
        self._num_arguments += 1
        value = value.removeprefix("\n").removesuffix("\n")  # the template's, around the value
        schema = self.schemas.get(key)
        member = f"{json.dumps(key, ensure_ascii=False)}: {value_json(value, schema)}"
        return ToolCallDelta(self.index, arguments=separator + member)

    def close(self) -> ToolCallDelta:
        return ToolCallDelta(self.index, arguments="}")


class Qwen3CoderToolParser(ToolCallParser):
    """`<tool_call>` blocks of `<function=NAME>` calls with `<parameter=KEY>` values (see the
    module); `tools`: the request's, which type the values."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = tools
        self._schemas = parameter_schemas(tools)
        self._state = _OUTSIDE
        self._held = ""
        self._block_raw: str | None = None  # the open block's text while it has no call
        self._call: _XmlCall | None = None  # the open function's call
        self._key = ""  # the open parameter's name
        self._value: list[str] = []  # and its text so far
        self._is_after_call = False  # whitespace here follows a call's block: dropped
        self._num_calls = 0

    def fresh(self) -> Qwen3CoderToolParser:
        return Qwen3CoderToolParser(self.tools)

    def feed(self, delta: str) -> list[Event]:
        text, self._held = self._held + delta, ""
        events: list[Event] = []
        while text:
            text = self._read(text, events)
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        events: list[Event] = []
        if self._state == _OUTSIDE:
            if held:
                events.append(held)
        elif self._call is not None:  # cut off: the parameters so far, and the closing brace
            if self._state == _IN_PARAMETER:
                self._value.append(held)  # a partial closing tag is value text after all
                self._end_parameter(events)
            events.append(self._call.close())
        elif self._block_raw is not None:  # a block cut off before its first call: content
            events.append(_BLOCK_START + self._block_raw + held)
        return events

    def _read(self, text: str, events: list[Event]) -> str:
        """Reads `text` from its start, as far as the state it is in goes; returns the rest."""
        if self._state == _OUTSIDE:
            return self._outside(text, events)
        if self._state == _IN_BLOCK:
            return self._in_block(text, events)
        if self._state == _FUNCTION_NAME:
            return self._function_name(text, events)
        if self._state == _IN_FUNCTION:
            return self._in_function(text, events)
        if self._state == _PARAMETER_NAME:
            return self._parameter_name(text)
        return self._in_parameter(text, events)

    def _outside(self, text: str, events: list[Event]) -> str:
        if self._is_after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._is_after_call = False
        before, tag, after = self._until_tag(text, (_BLOCK_START,))
        if before:
            events.append(before)
        if tag:
            self._state, self._block_raw = _IN_BLOCK, ""
        return after

    def _in_block(self, text: str, events: list[Event]) -> str:
        """Between a block's calls; the text there is content only if the block has none."""
        before, tag, after = self._until_tag(text, (_FUNCTION_START, _BLOCK_END))
        self._keep_raw(before + tag)
        if tag == _FUNCTION_START:
            self._state = _FUNCTION_NAME
        elif tag:
            self._end_block(events)
        return after

    def _function_name(self, text: str, events: list[Event]) -> str:
        read = self._name(text)
        if read is None:
            return ""
        name, is_tag = read
        if not is_tag:  # `<function=` and no name: text of the block
            self._keep_raw(name)
            self._state = _IN_BLOCK
            return text[len(name):]
        self._call = _XmlCall(self._num_calls, name, self._schemas.get(name, {}))
        self._num_calls += 1
        self._block_raw = None  # the block is a call's: its other text is not content
        events.extend(self._call.start())
        self._state = _IN_FUNCTION
        return text[len(name) + 1:]

    def _in_function(self, text: str, events: list[Event]) -> str:
        """Between a call's parameters, where text is ignored."""
        _, tag, after = self._until_tag(text, (_PARAMETER_START, _FUNCTION_END, _BLOCK_END))
        if tag == _PARAMETER_START:
            self._state = _PARAMETER_NAME
        elif tag:
            self._end_call(tag, events)
        return after

    def _parameter_name(self, text: str) -> str:
        read = self._name(text)
        if read is None:
            return ""
        name, is_tag = read
        if not is_tag:  # `<parameter=` and no name: text of the function, ignored
            self._state = _IN_FUNCTION
            return text[len(name):]
        self._key, self._value, self._state = name, [], _IN_PARAMETER
        return text[len(name) + 1:]

    def _in_parameter(self, text: str, events: list[Event]) -> str:
        """A parameter's value, up to its `</parameter>`, or the end of its function or block
        where the model left that out."""
        before, tag, after = self._until_tag(text, (_PARAMETER_END, _FUNCTION_END, _BLOCK_END))
        self._value.append(before)
        if tag:
            self._end_parameter(events)
            if tag == _PARAMETER_END:
                self._state = _IN_FUNCTION
            else:
                self._end_call(tag, events)
        return after

    def _end_parameter(self, events: list[Event]) -> None:
        assert self._call is not None
        events.append(self._call.argument(self._key, "".join(self._value)))

    def _end_call(self, closing_tag: str, events: list[Event]) -> None:
        """`</function>` ends the call; `</tool_call>` ends it and its block."""
        assert self._call is not None
        events.append(self._call.close())
        self._call = None
        if closing_tag == _BLOCK_END:
            self._end_block(events)
        else:
            self._state = _IN_BLOCK

    def _end_block(self, events: list[Event]) -> None:
        if self._block_raw is None:
            self._is_after_call = True
        else:  # no call in it: the block is content, tags included
            events.append(_BLOCK_START + self._block_raw)
        self._state = _OUTSIDE

    def _keep_raw(self, text: str) -> None:
        if self._block_raw is not None:
            self._block_raw += text

    def _name(self, text: str) -> tuple[str, bool] | None:
        """The name `text` starts with (after `<function=` or `<parameter=`) and whether `>` ends
        it there, making its tag; None while it may go on (then `text` is held back)."""
        end = _NAME_END.search(text)
        if end is None:
            self._held = text
            return None
        name = text[:end.start()]
        return name, bool(name) and end.group() == ">"

    def _until_tag(self, text: str, tags: tuple[str, ...]) -> tuple[str, str, str]:
        """(the text before the first of `tags`, that tag, the text after it). Without one, the
        tag is "" and the end of `text` that may begin one is held back."""
        found = [(at, tag) for tag in tags if (at := text.find(tag)) != -1]
        if found:
            at, tag = min(found)
            return text[:at], tag, text[at + len(tag):]
        keep = len(text) - max(partial_tag_length(text, tag) for tag in tags)
        self._held = text[keep:]
        return text[:keep], "", ""

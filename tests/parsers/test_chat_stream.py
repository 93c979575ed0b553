"""The chat stream parser (nanoserve/parsers/chat_stream.py): the reasoning split and tool calls
as neutral events, in order, adding up to the whole-text parse however the text is chunked."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from nanoserve.parsers.reasoning import make_reasoning_parser
from nanoserve.parsers.tool_calls import make_tool_call_parser

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
OUTPUT = ('<think>Paris, then the time.</think>Checking.<tool_call>{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_time", '
          '"arguments": {}}</tool_call> Done.')


def parser(is_parallel_allowed: bool = True) -> ChatStreamParser:
    return ChatStreamParser(make_reasoning_parser("qwen3", False),
                            make_tool_call_parser("hermes"), is_parallel_allowed)


def stream(chat: ChatStreamParser, text: str, cuts: list[int]) -> list[ChatEvent]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {len(text)})
    events: list[ChatEvent] = []
    for a, b in zip([0, *points[:-1]], points, strict=True):
        events += chat.feed(text[a:b], is_final=b == len(text))
    return events


def summary(events: list[ChatEvent]) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls as (name, arguments)), checking each call's events run
    start, arguments, end, with nothing else in between."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: list[tuple[str, str]] = []
    open_call: int | None = None
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None and event.index == len(calls)
            assert CALL_ID.fullmatch(event.id)
            calls.append((event.name, ""))
            open_call = event.index
        elif isinstance(event, ToolCallArguments):
            assert event.index == open_call and event.delta
            calls[event.index] = (calls[event.index][0], calls[event.index][1] + event.delta)
        elif isinstance(event, ToolCallEnd):
            assert event.index == open_call
            open_call = None
        else:
            assert open_call is None, f"{event} inside call {open_call}"
            assert event.text
    assert open_call is None
    return reasoning, content, calls


def test_events_of_one_output_in_order() -> None:
    events = parser().feed(OUTPUT, is_final=True)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ReasoningDelta", "TextDelta", "ToolCallStart", "ToolCallArguments",
                     "ToolCallEnd", "ToolCallStart", "ToolCallArguments", "ToolCallEnd",
                     "TextDelta"]
    assert summary(events) == ("Paris, then the time.", "Checking.Done.",
                               [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


def test_a_call_ends_when_the_output_does() -> None:
    chat = parser()
    events = chat.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert chat.feed("", is_final=True) == [ToolCallEnd(0)]


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    _, content, calls = summary(parser(is_parallel_allowed=False).feed(OUTPUT, True))
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == "Checking.Done."
    parsed = parser(is_parallel_allowed=False).parse(OUTPUT)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


def test_without_parsers_the_text_is_content() -> None:
    chat = ChatStreamParser(None, None)
    assert chat.feed("<think>a</think>b") == [TextDelta("<think>a</think>b")]
    assert chat.feed("", is_final=True) == []
    assert not chat.splits_reasoning
    assert chat.parse("").content == ""  # the text as it is: "" stays ""
    assert parser().parse("").content is None


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
       is_parallel_allowed=st.booleans())
def test_streamed_events_add_up_to_the_whole_parse(cuts: list[int],
                                                   is_parallel_allowed: bool) -> None:
    reasoning, content, calls = summary(stream(parser(is_parallel_allowed), OUTPUT, cuts))
    whole = parser(is_parallel_allowed).parse(OUTPUT)
    assert reasoning == whole.reasoning and content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


QWEN3_CODER_OUTPUT = ("<think>Paris, then Oslo.</think>Checking.\n\n<tool_call>\n"
                      "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                      "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                      "</tool_call>")


def test_qwen3_coder_calls_after_the_reasoning_in_any_chunking() -> None:
    def chat() -> ChatStreamParser:
        return ChatStreamParser(make_reasoning_parser("qwen3", False),
                                make_tool_call_parser("qwen3_coder"))

    expected = ("Paris, then Oslo.", "Checking.\n\n",
                [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')])
    whole = chat().parse(QWEN3_CODER_OUTPUT)
    assert (whole.reasoning, whole.content,
            [(c.name, c.arguments) for c in whole.tool_calls]) == expected
    one_at_a_time = stream(chat(), QWEN3_CODER_OUTPUT, list(range(len(QWEN3_CODER_OUTPUT))))
    assert summary(one_at_a_time) == expected
    for at in range(len(QWEN3_CODER_OUTPUT) + 1):
        assert summary(stream(chat(), QWEN3_CODER_OUTPUT, [at])) == expected, at

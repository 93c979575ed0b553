"""The `gemma4` tool-call parser (nanoserve/parsers/gemma4_tool_calls.py): llama.cpp's Gemma 4
parse vectors and harder ones (strings holding quotes, braces, commas, newlines and backslashes;
nesting; parallel and cut-off calls), whole, streamed in every chunking and through
`ChatStreamParser` with the `gemma4` reasoning parser; arguments are always JSON."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
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
from nanoserve.parsers.tool_calls import ToolCallDelta, assemble, make_tool_call_parser

Q = '<|"|>'  # Gemma 4's string delimiter token
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
ANSWER = "Hello, world!\nWhat's up?"


def call(name: str, body: str) -> str:
    return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"


# llama.cpp's Gemma 4 parse vectors (sdist llama.cpp `tests/test-chat.cpp`, the "Google Gemma 4"
# block, l.2992-3120): (test name, output, reasoning, content, [(name, arguments)]). llama.cpp
# compares arguments as JSON values; its spacing differs from json.dumps's.
LLAMA_CPP_VECTORS: list[tuple[str, str, str | None, str | None, list[tuple[str, str]]]] = [
    ("Simple tool call with string argument", call("get_time", f"city:{Q}London{Q}"),
     None, None, [("get_time", '{"city": "London"}')]),
    ("Tool call with string argument containing special chars",
     call("get_time", f"city:{Q}San Francisco{Q}"), None, None,
     [("get_time", '{"city": "San Francisco"}')]),
    ("Tool call with empty args", call("empty_args", ""), None, None, [("empty_args", "{}")]),
    ("Tool call with string and content", ANSWER + call("get_time", f"city:{Q}Paris{Q}"),
     None, ANSWER, [("get_time", '{"city": "Paris"}')]),
    # (tool_choice=required: nanoserve forces its JSON call list by grammar instead; the
    # model's own format still parses the same under "auto")
    ("Required tool call", call("get_time", f"city:{Q}Paris{Q}"), None, None,
     [("get_time", '{"city": "Paris"}')]),
    ("Required tool call after reasoning",
     "<|channel>thought\nI'm\nthinking<channel|>" + call("get_time", f"city:{Q}Paris{Q}"),
     "I'm\nthinking", None, [("get_time", '{"city": "Paris"}')]),
    ("Parallel tool calls",
     call("get_time", f"city:{Q}London{Q}") + call("get_weather", f"city:{Q}Paris{Q}"),
     None, None, [("get_time", '{"city": "London"}'), ("get_weather", '{"city": "Paris"}')]),
    ("Tool call with integer argument (number type)", call("special_function", "arg1:42"),
     None, None, [("special_function", '{"arg1": 42}')]),
    ("Tool call with negative number argument", call("special_function", "arg1:-7"),
     None, None, [("special_function", '{"arg1": -7}')]),
    ("Tool call with decimal number argument", call("amount", "orig:3.14"), None, None,
     [("amount", '{"orig": 3.14}')]),
    ("Tool call with boolean argument (true)", call("toggle", "enabled:true"), None, None,
     [("toggle", '{"enabled": true}')]),
    ("Tool call with boolean argument (false)", call("toggle", "enabled:false"), None, None,
     [("toggle", '{"enabled": false}')]),
    ("Tool call with null argument", call("set_nullable", "value:null"), None, None,
     [("set_nullable", '{"value": null}')]),
    ("Tool call with array argument (todo list)",
     call("todo_list", f"todos:[{Q}buy milk{Q},{Q}walk dog{Q}]"), None, None,
     [("todo_list", '{"todos":["buy milk","walk dog"]}')]),
    ("Tool call with object/dict argument",
     call("set_config", f"config:{{theme:{Q}dark{Q},count:3}}"), None, None,
     [("set_config", '{"config":{"theme":"dark","count":3}}')]),
    ("Tool call with empty array", call("todo_list", "todos:[]"), None, None,
     [("todo_list", '{"todos":[]}')]),
    ("Tool call with empty dict", call("set_config", "config:{}"), None, None,
     [("set_config", '{"config":{}}')]),
    ("Tool call with scientific notation number", call("amount", "orig:1.5e10"), None, None,
     [("amount", '{"orig": 1.5e10}')]),
]

# Beyond llama.cpp's vectors: (output, reasoning, content, [(name, arguments as json.dumps
# writes them)]), compared as text.
CASES: list[tuple[str, str | None, str | None, list[tuple[str, str]]]] = [
    # strings are verbatim: JSON's specials inside them are escaped in the arguments
    (call("write", f'path:{Q}a "b".txt{Q},text:{Q}x = {{"k": [1, 2]}}, y\n\tz \\ \\n{Q}'),
     None, None,
     [("write", json.dumps({"path": 'a "b".txt', "text": 'x = {"k": [1, 2]}, y\n\tz \\ \\n'}))]),
    (call("say", f"s:{Q}}}<tool_call|>{{{Q}"), None, None,  # the end tag inside a string
     [("say", '{"s": "}<tool_call|>{"}')]),
    (call("f", f"a:{{b:[{{c:{Q}x{Q}}},[1,2.5,-0.5e-3]],d:null}},e:[]"), None, None,
     [("f", '{"a": {"b": [{"c": "x"}, [1, 2.5, -0.0005]], "d": null}, "e": []}')]),
    (call("f", f"z:1,a:2,m:{Q}{Q}"), None, None, [("f", '{"z": 1, "a": 2, "m": ""}')]),
    (call("f", f"s:{Q}café 世界 🦜{Q}"), None, None, [("f", '{"s": "café 世界 🦜"}')]),
    (call("mcp.tool-name_2", ""), None, None, [("mcp.tool-name_2", "{}")]),
    # parallel calls with whitespace and text between them
    (call("a", "x:1") + "\n" + call("b", "y:2") + " and more", None, "and more",
     [("a", '{"x": 1}'), ("b", '{"y": 2}')]),
    # reasoning first, content before the call, an empty section after it
    ("<|channel>thought\nNeed the time.<channel|>Checking." + call("get_time", f"city:{Q}Oslo{Q}")
     + "<|channel>thought\n<channel|>", "Need the time.", "Checking.",
     [("get_time", '{"city": "Oslo"}')]),
    # lenient: quoted keys, JSON-quoted values, spaces, a missing comma, a trailing comma,
    # Python's words, a bare word, a key without a value
    (call("f", f"{Q}k{Q}: {Q}v{Q}, n : 1 ,"), None, None, [("f", '{"k": "v", "n": 1}')]),
    (call("f", 'a:"x, \\"y\\"",b:True,c:None,d:celsius degrees'), None, None,
     [("f", '{"a": "x, \\"y\\"", "b": "True", "c": null, "d": "celsius degrees"}')]),
    (call("f", f"a:{Q}x{Q} b:2"), None, None, [("f", '{"a": "x", "b": 2}')]),
    (call("f", "a:,b:"), None, None, [("f", "{}")]),
    (call("f", "a:[1,,2,]"), None, None, [("f", '{"a": [1, 2]}')]),
    # a call whose closing brace is missing ends at <tool_call|>
    ("<|tool_call>call:f{a:[1,{b:2<tool_call|>after", None, "after",
     [("f", '{"a": [1, {"b": 2}]}')]),
    # text between a call's brace and its end tag is ignored
    ("<|tool_call>call:f{a:1} junk", None, "junk", [("f", '{"a": 1}')]),
    # not calls: the tag and its text are content
    ("<|tool_call>oops" + call("f", ""), None, "<|tool_call>oops", [("f", "{}")]),
    ("<|tool_call>call:bad name{}<tool_call|>x", None, "<|tool_call>call:bad name{}<tool_call|>x",
     []),
    ("<|tool_call>call:{a:1}", None, "<|tool_call>call:{a:1}", []),
    ("plain < text <|tool", None, "plain < text <|tool", []),
    # cut off (max_tokens): what the call had, closed
    ("<|tool_call>call:f{a:" + Q + "half a str", None, None, [("f", '{"a": "half a str"}')]),
    ("<|tool_call>call:f{a:" + Q + "ends in <|\"", None, None, [("f", '{"a": "ends in <|\\""}')]),
    ("<|tool_call>call:f{a:[1,{b:tr", None, None, [("f", '{"a": [1, {"b": "tr"}]}')]),
    ("<|tool_call>call:f{a:12", None, None, [("f", '{"a": 12}')]),
    ("<|tool_call>call:f{a:1,bb", None, None, [("f", '{"a": 1}')]),
    ("<|tool_call>call:f{a:1}<tool_ca", None, None, [("f", '{"a": 1}')]),
    ("<|tool_call>call:f{" + Q + "ke", None, None, [("f", "{}")]),
    ("<|tool_call>call:get_wea", None, "<|tool_call>call:get_wea", []),
    ("<|tool_call>cal", None, "<|tool_call>cal", []),
    ("", None, None, []),
]


def chat() -> ChatStreamParser:
    return ChatStreamParser(make_reasoning_parser("gemma4", False),
                            make_tool_call_parser("gemma4"))


def summary(events: list[ChatEvent]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
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
    return reasoning or None, content or None, calls


def stream(text: str, points: list[int]) -> tuple[str | None, str | None,
                                                    list[tuple[str, str]]]:
    """The summary of the stream of `text` cut at `points` (sorted, inside the text)."""
    streaming = chat()
    bounds = [0, *points, len(text)]
    events: list[ChatEvent] = []
    for i in range(len(bounds) - 1):
        events += streaming.feed(text[bounds[i]:bounds[i + 1]], is_final=i == len(bounds) - 2)
    return summary(events)


def whole(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    parsed = chat().parse(text)
    for tool_call in parsed.tool_calls:
        assert CALL_ID.fullmatch(tool_call.id)
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def every_chunking(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The whole parse; the stream in two pieces at every point, one character at a time and in
    random pieces equals it."""
    expected = whole(text)
    assert stream(text, list(range(1, len(text)))) == expected
    for at in range(len(text) + 1):
        assert stream(text, [at] if 0 < at < len(text) else []) == expected, at
    rng = random.Random(len(text))
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(5, max(len(text) - 1, 0))))
        assert stream(text, points) == expected
    return expected


def as_values(calls: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize(("name", "text", "reasoning", "content", "calls"), LLAMA_CPP_VECTORS,
                         ids=[v[0] for v in LLAMA_CPP_VECTORS])
def test_llama_cpp_vectors(name: str, text: str, reasoning: str | None, content: str | None,
                           calls: list[tuple[str, str]]) -> None:
    got_reasoning, got_content, got_calls = every_chunking(text)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert as_values(got_calls) == as_values(calls)
    for _, arguments in got_calls:  # json.dumps's form
        assert arguments == json.dumps(json.loads(arguments), ensure_ascii=False)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_cases(text: str, reasoning: str | None, content: str | None,
               calls: list[tuple[str, str]]) -> None:
    assert every_chunking(text) == (reasoning, content, calls)


def test_the_name_goes_out_at_the_brace_and_strings_as_they_come() -> None:
    parser = make_tool_call_parser("gemma4")
    assert parser.feed("Sure.<|tool") == ["Sure."]
    assert parser.feed("_call>call:get_") == []
    (header, opening) = parser.feed("weather{")
    assert isinstance(header, ToolCallDelta) and (header.index, header.name) == (0, "get_weather")
    assert opening == ToolCallDelta(0, arguments="{")
    assert parser.feed("city:") == []  # a key goes with its value's first character
    assert parser.feed(f"{Q}New Y") == [ToolCallDelta(0, arguments='"city": "New Y')]
    assert parser.feed('ork "NY"<|') == [ToolCallDelta(0, arguments='ork \\"NY\\"')]
    assert parser.feed('"|>,days:1') == [ToolCallDelta(0, arguments='"')]
    assert parser.feed("4}") == [ToolCallDelta(0, arguments=', "days": 14}')]
    assert parser.feed("<tool_call|>\n") == []
    second, arguments = parser.feed("<|tool_call>call:g{}")  # (the "\n" after a call: dropped)
    assert isinstance(second, ToolCallDelta) and (second.index, second.name) == (1, "g")
    assert arguments == ToolCallDelta(1, arguments="{}")
    assert parser.finish() == []


def test_parallel_calls_are_numbered_in_order() -> None:
    parser = make_tool_call_parser("gemma4")
    events = parser.feed(call("a", "x:1") + call("b", "") + call("c", f"s:{Q}{Q}"))
    events += parser.finish()
    starts = [e for e in events if isinstance(e, ToolCallDelta) and e.name is not None]
    assert [(e.index, e.name) for e in starts] == [(0, "a"), (1, "b"), (2, "c")]
    assert [c.arguments for c in assemble(events)[1]] == ['{"x": 1}', "{}", '{"s": ""}']


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    text = call("a", "x:1") + call("b", "y:2")
    only = ChatStreamParser(None, make_tool_call_parser("gemma4"), is_parallel_allowed=False)
    assert [(c.name, c.arguments) for c in only.parse(text).tool_calls] == [("a", '{"x": 1}')]


PIECES = ["<|tool_call>", "<tool_call|>", "call:", "f", "get_time", "{", "}", "[", "]", ",",
          ":", Q, "<|", '"', "\\", "\n", " ", "x", "42", "-1.5e3", "true", "null", "<|channel>",
          "<channel|>", "thought\n", "世", "<tool_", "<|tool_", "call:f{", f"a:{Q}", "<"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(alphabet='{}[],:<|>"ax \n',
                                                           max_size=3)),
                 max_size=24).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_any_text_streams_to_the_whole_parse_and_json_arguments(text: str,
                                                                 cuts: list[int]) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts} - {0, len(text)})
    expected = whole(text)
    assert stream(text, points) == expected
    for _, arguments in expected[2]:
        json.loads(arguments)  # always JSON, however broken or cut the call


@settings(max_examples=200, deadline=None)
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(alphabet='ab "{}[],:\\\n\t<|>é', max_size=8).filter(lambda s: Q not in s),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), inner, max_size=3),
    max_leaves=8), cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_the_templates_own_writing_reads_back(value: Any, cuts: list[int]) -> None:
    """Arguments written as the Gemma 4 template writes a call's (`format_argument` with bare
    keys, here in insertion order) parse back to the same value, streamed or whole, even where
    strings hold JSON's and Gemma's own punctuation."""
    text = call("f", ",".join(f"{k}:{gemma(v)}" for k, v in {"v": value, "w": 1}.items()))
    points = sorted({c % (len(text) + 1) for c in cuts} - {0, len(text)})
    _, content, calls = stream(text, points)
    assert content is None and len(calls) == 1
    assert json.loads(calls[0][1]) == {"v": value, "w": 1}
    assert calls[0][1] == json.dumps({"v": value, "w": 1}, ensure_ascii=False)


def gemma(value: Any) -> str:
    """`value` as the template's `format_argument(..., escape_keys=False)` writes it (numbers as
    Jinja prints them, which is Python's repr)."""
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"  # (Jinja prints None; the model writes null)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma(v) for v in value) + "]"
    return repr(value)


def test_nothing_is_held_once_a_string_piece_is_known() -> None:
    """A long string argument streams (a code-writing tool's file), it is not held to the end."""
    parser = make_tool_call_parser("gemma4")
    parser.feed(f"<|tool_call>call:write{{text:{Q}")
    sent = ""
    for i in range(50):
        for event in parser.feed(f"line {i}\n"):
            assert isinstance(event, ToolCallDelta)
            sent += event.arguments
        assert sent.endswith(f"line {i}\\n")

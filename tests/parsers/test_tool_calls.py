"""The tool-call parsers (nanoserve/parsers/tool_calls.py): what they read out of whole texts, and
that every way of splitting a text into streamed deltas adds up to the same content and calls."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.parsers.tool_calls import (
    NamedFunctionParser,
    ToolCallDelta,
    ToolCallParser,
    assemble,
    make_tool_call_parser,
    required_calls_parser,
)

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def calls_of(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parser.parse(text)
    for call in calls:
        assert CALL_ID.fullmatch(call.id)
    return content, [(call.name, call.arguments) for call in calls]


def streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str | None,
                                                                  list[tuple[str, str]]]:
    """Feeds the pieces to a fresh parser; checks each call's deltas are shaped as OpenAI's
    (first its id and name, then arguments only), and returns what they add up to."""
    parser = parser.fresh()
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    seen: set[int] = set()
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.index in seen:
                assert event.name is None and event.id is None and event.arguments
            else:
                assert event.name is not None and event.id and event.arguments == ""
                assert event.index == len(seen)  # calls are numbered in order
                seen.add(event.index)
    content, calls = assemble(events)
    return content, [(call.name, call.arguments) for call in calls]


def every_split(parser: ToolCallParser, text: str) -> None:
    """Whole-text parse == streaming in two pieces at every point, char by char, and in
    random pieces."""
    whole = calls_of(parser, text)
    assert streamed(parser, list(text)) == whole
    for at in range(len(text) + 1):
        assert streamed(parser, [text[:at], text[at:]]) == whole, at
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(parser, pieces) == whole


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'

HERMES_CASES = [
    # (text, content, [(name, arguments)])
    ("Let me check.\n<tool_call>\n" + WEATHER + "\n</tool_call>",
     "Let me check.\n", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n"
     '{"arguments": {"q": "a } \\" ]", "n": [1, {"x": null}]}, "name": "search"}\n</tool_call>\n',
     None, [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
            ("search", '{"q": "a } \\" ]", "n": [1, {"x": null}]}')]),
    ("plain answer, no tools < > <tool", "plain answer, no tools < > <tool", []),
    ("Use <tool_call>like this</tool_call> here.", "Use <tool_call>like this</tool_call> here.",
     []),
    ('<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"a": "cut off mid-str',
     None, [("f", '{"a": "cut off mid-str')]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and after', "and after",
     [("f", "{}")]),
    ('<tool_call>{"name": "caf\\u00e9", "arguments": {"s": "\\u00e9t\\u00e9"}}</tool_call>',
     None, [("café", '{"s": "\\u00e9t\\u00e9"}')]),
    ('<tool_call>{"name": "f", "arguments": 5}</tool_call>', None, [("f", "5")]),
    ("<tool_call>\n", "<tool_call>\n", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole_text(text: str, content: str | None,
                           calls: list[tuple[str, str]]) -> None:
    assert calls_of(make_tool_call_parser("hermes"), text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_every_split_equals_the_whole(text: str, content: str | None,
                                             calls: list[tuple[str, str]]) -> None:
    every_split(make_tool_call_parser("hermes"), text)


def test_hermes_holds_back_a_partial_tag_but_streams_arguments() -> None:
    parser = make_tool_call_parser("hermes")
    assert parser.feed("Sure <tool") == ["Sure "]
    assert parser.feed("_ca") == []
    (header,) = parser.feed('ll>{"name": "f", ')
    assert isinstance(header, ToolCallDelta) and (header.index, header.name) == (0, "f")
    assert parser.feed('"arguments": {"a"') == [ToolCallDelta(0, arguments='{"a"')]
    assert parser.feed(": 1}}</tool") == [ToolCallDelta(0, arguments=": 1}")]
    assert parser.feed("_call>\n") == []
    assert parser.finish() == []


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    ('  {"type": "function", "name": "a", "parameters": {"x": [1, 2]}}', None,
     [("a", '{"x": [1, 2]}')]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("The weather is fine.", "The weather is fine.", []),
    ("<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ('{"name": "a", "parameters": {}} then text', "then text", [("a", "{}")]),
    ("   ", "   ", []),
    ("<|python", "<|python", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parser = make_tool_call_parser("llama3_json")
    assert calls_of(parser, text) == (content, calls)
    every_split(parser, text)


REQUIRED_CASES = [
    ('[{"name": "a", "parameters": {"x": true}}, {"name":"b","parameters":{"y":"]"}}]', None,
     [("a", '{"x": true}'), ("b", '{"y":"]"}')]),
    ('\n[\n  {"name": "a", "parameters": {}}\n]\n', None, [("a", "{}")]),
    ('[{"name": "a", "parameters": {"x": 1', None, [("a", '{"x": 1')]),  # cut off
]


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED_CASES)
def test_required_array(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parser = required_calls_parser()
    assert calls_of(parser, text) == (content, calls)
    every_split(parser, text)


def test_named_function_output_is_its_arguments() -> None:
    parser = NamedFunctionParser("get_weather")
    text = '{"city": "Paris"}'
    assert calls_of(parser, text) == (None, [("get_weather", text)])
    every_split(parser, text)
    assert calls_of(parser, "") == (None, [("get_weather", "")])


QWEN3_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "detailed": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "content": {"type": "string"}}}}},
]
PARIS_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
PARIS_ARGUMENTS = '{"city": "Paris", "days": 3}'

QWEN3_CODER_CASES = [
    # (text, content, [(name, arguments)])
    ("I'll check.\n\n" + PARIS_CALL, "I'll check.\n\n", [("get_weather", PARIS_ARGUMENTS)]),
    (PARIS_CALL + "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\nDone.",
     "Done.", [("get_weather", PARIS_ARGUMENTS), ("get_time", "{}")]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"
     "\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]),
    # a value keeps its inner newlines and text that only looks like tags; quotes are escaped
    ('<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n'
     '<parameter=content>\nif a <b > c:\n    print("</para")\n\n</parameter>\n</function>\n'
     "</tool_call>", None,
     [("write_file", '{"path": "a.py", "content": "if a <b > c:\\n    print(\\"</para\\")\\n"}')]),
    # the schema types each value; a value the schema does not type is read as JSON if it is
    ("<tool_call><function=get_weather><parameter=city>Zürich</parameter><parameter=detailed>"
     "True</parameter><parameter=days>three</parameter><parameter=extra>[1, 2]</parameter>"
     "</function></tool_call>", None,
     [("get_weather", '{"city": "Zürich", "detailed": true, "days": "three", "extra": [1, 2]}')]),
    ("<tool_call>\n<function=undeclared>\n<parameter=n>\n5\n</parameter>\n<parameter=s>\nhi\n"
     "</parameter>\n</function>\n</tool_call>", None, [("undeclared", '{"n": 5, "s": "hi"}')]),
    # blocks without a call are content, tags included, verbatim
    ("Use <tool_call>\nlike this\n</tool_call> here.",
     "Use <tool_call>\nlike this\n</tool_call> here.", []),
    ("<tool_call><function={{ tool.name }}></function></tool_call>",
     "<tool_call><function={{ tool.name }}></function></tool_call>", []),
    ("<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),
    ("plain answer <function=f> < <tool", "plain answer <function=f> < <tool", []),
    # missing closing tags: a closing tag closes what is open inside it
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     None, [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</tool_call>ok",
     "ok", [("get_weather", '{"days": 2}')]),
    # cut off by max_tokens: the parameters so far (an open one too), and the closing brace
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None,
     [("get_weather", '{"city": "Par"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da",
     None, [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param", None,
     [("get_weather", '{"city": "Paris\\n</param"}')]),
    ("<tool_call>\n<function=now>", None, [("now", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), QWEN3_CODER_CASES)
def test_qwen3_coder(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parser = make_tool_call_parser("qwen3_coder", QWEN3_TOOLS)
    assert calls_of(parser, text) == (content, calls)
    every_split(parser, text)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


def test_qwen3_coder_streams_each_parameter_as_it_closes() -> None:
    parser = make_tool_call_parser("qwen3_coder", QWEN3_TOOLS)
    assert parser.feed("Sure.\n<tool") == ["Sure.\n"]
    assert parser.feed("_call>\n<function=get_") == []
    header, brace = parser.feed("weather>\n")
    assert isinstance(header, ToolCallDelta) and (header.index, header.name) == (0, "get_weather")
    assert brace == ToolCallDelta(0, arguments="{")
    assert parser.feed("<parameter=city>\nPar") == []
    assert parser.feed("is\n</parameter>\n<parameter=days>\n3\n</para") == [
        ToolCallDelta(0, arguments='"city": "Paris"')]
    assert parser.feed("meter>\n") == [ToolCallDelta(0, arguments=', "days": 3')]
    assert parser.feed("</function>\n</tool") == [ToolCallDelta(0, arguments="}")]
    assert parser.feed("_call>\n") == []
    assert parser.finish() == []


def test_qwen3_coder_without_tools_reads_values_as_json_where_they_are() -> None:
    parser = make_tool_call_parser("qwen3_coder")
    assert calls_of(parser, PARIS_CALL) == (None, [("get_weather", PARIS_ARGUMENTS)])


def test_parse_is_independent_of_streaming_in_progress() -> None:
    parser = make_tool_call_parser("hermes")
    parser.feed("<tool_call>{\"name\": \"f\", ")
    assert calls_of(parser, "hello") == ("hello", [])


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match=r"unknown tool call parser 'nope'.*hermes"):
        make_tool_call_parser("nope")


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "{", "}", "[", "]", '"name"',
             '"arguments"', '"parameters"', ":", ",", " ", "\n", '"f"', '"a\\"b"', "1", "x",
             "<|python_tag|>", ";", "null", '"}"']
XML_FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "<function=", "<function=f>",
                 "</function>", "<parameter=", "<parameter=x>", "<parameter=y>", "</parameter>",
                 "</para", "f>", "x>", ">", "<", " ", "\n", "1", "True", "None", "[1, 2]",
                 "{'a': 1}", '"q"', "{{ name }}"]
XML_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "object"}}}}}]


def any_parser(name: str) -> ToolCallParser:
    if name == "required":
        return required_calls_parser()
    return make_tool_call_parser(name, XML_TOOLS if name == "qwen3_coder" else None)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(["hermes", "llama3_json", "required", "qwen3_coder"]),
       data=st.data(), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6))
def test_any_text_streams_as_it_parses(name: str, data: st.DataObject, cuts: list[int]) -> None:
    """Arbitrary mixes of tags, JSON or XML pieces and text, cut anywhere or fed a character at
    a time: the stream adds up to the whole-text parse, and content never loses or invents text
    when there are no calls."""
    fragments = XML_FRAGMENTS if name == "qwen3_coder" else FRAGMENTS
    text = "".join(data.draw(st.lists(st.sampled_from(fragments), max_size=30), label="parts"))
    parser = any_parser(name)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = calls_of(parser, text)
    assert streamed(parser, pieces) == whole
    assert streamed(parser, list(text)) == whole
    content, calls = whole
    if not calls:
        assert (content or "") == text
    for _, arguments in calls:
        if name == "qwen3_coder":  # built from the parameters
            assert isinstance(json.loads(arguments), dict)
        else:  # as the model wrote them
            assert arguments in text or arguments == "{}"


def test_streamed_arguments_are_valid_json_once_complete() -> None:
    parser = make_tool_call_parser("hermes")
    text = "<tool_call>" + WEATHER + "</tool_call>"
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    arguments = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert sum(1 for e in events if isinstance(e, ToolCallDelta) and e.arguments) > 5

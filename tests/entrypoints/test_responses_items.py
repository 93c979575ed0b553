"""The Responses API's two translations, without a server: a body into the neutral chat input
(`responses/request.py`), and the parsers' neutral events into output items and stream events
(`responses/items.py`), reasoning included (the default model has none)."""

from __future__ import annotations

from typing import Any

import pytest

from nanoserve.entrypoints.responses.items import OutputItems
from nanoserve.entrypoints.responses.protocol import ResponsesRequest
from nanoserve.entrypoints.responses.request import renamed, responses_input
from nanoserve.entrypoints.serving.chat_input import ContentPart, MessageInput, ToolCallInput
from nanoserve.entrypoints.serving.errors import APIError
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


def translate(**body: Any) -> Any:
    return responses_input(ResponsesRequest.model_validate(body))


def test_items_become_chat_turns() -> None:
    chat = translate(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                     {"type": "input_text", "text": "In Paris."}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "9:00"}]},
        {"type": "reasoning", "summary": []},  # encrypted only: nothing to give the template
        {"role": "assistant", "content": "It is 18 C."},
    ]).chat
    assert chat.messages == (
        MessageInput("system", "Be brief."), MessageInput("developer", "Use tools."),
        MessageInput("user", (ContentPart("text", "Weather?"), ContentPart("text", "In Paris."))),
        MessageInput("assistant", (ContentPart("text", "Checking."),), tool_calls=(
            ToolCallInput("call_1", "get_weather", '{"city": "Paris"}'),
            ToolCallInput("call_2", "get_time", "{}")), reasoning="Call it."),
        MessageInput("tool", "18 C", tool_call_id="call_1"),
        MessageInput("tool", "9:00", tool_call_id="call_2"),
        MessageInput("assistant", "It is 18 C."))


def test_tools_choice_format_and_limits_translate() -> None:
    translated = translate(
        input="hi", max_output_tokens=7, temperature=0.5, top_p=0.9, stream=True,
        tools=[{"type": "web_search"}, {"type": "function", "name": "f", "strict": True,
                                        "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}})
    chat = translated.chat
    assert chat.messages == (MessageInput("user", "hi"),)
    assert chat.tools is not None and [t.function.name for t in chat.tools] == ["f"]
    assert chat.tools[0].template == {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}
    assert translated.tool_indices == (1,)
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format.response_format == {
        "type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}
    sampling = chat.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stream) == (
        7, 0.5, 0.9, True)
    assert translate(input="hi", tools=[{"type": "local_shell"}]).chat.tools is None


def test_shared_errors_get_this_apis_names() -> None:
    translated = translate(input="hi", tools=[{"type": "web_search"},
                                              {"type": "function", "name": "f"}])
    error = renamed(APIError(400, "bad", "tools.0.function.parameters"), translated)
    assert error.param == "tools.1.parameters"
    error = renamed(APIError(400, "response_format.json_schema.name must be a non-empty "
                                  "string", "response_format.json_schema.name"), translated)
    assert (error.param, error.message) == (
        "text.format.name", "text.format.name must be a non-empty string")
    error = renamed(APIError(400, "'max_tokens' or 'max_completion_tokens' is too large: 9",
                             "max_tokens"), translated)
    assert (error.param, error.message) == ("max_output_tokens",
                                            "max_output_tokens is too large: 9")
    assert renamed(APIError(400, "x", "messages.2.content"), translated).param == "input"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "local_shell_call"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input.0.content.0.text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": "hi", "tool_choice": {"type": "custom", "name": "apply_patch"}}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_items_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        translate(**body)
    assert refused.value.status == 400 and refused.value.param == param


def build(events: list[list[ChatEvent]], status: str = "completed"
          ) -> tuple[OutputItems, list[dict[str, Any]]]:
    items = OutputItems()
    out = [e for chunk in events for e in items.feed(chunk)]
    return items, out + items.finish(status)


def test_reasoning_text_and_calls_become_items() -> None:
    items, events = build([
        [ReasoningDelta("Let me "), ReasoningDelta("think.")],
        [TextDelta("\n\n"), TextDelta("Checking.")],
        [ToolCallStart(0, "call_a", "get_weather"), ToolCallArguments(0, '{"city": '),
         ToolCallArguments(0, '"Paris"}'), ToolCallEnd(0), TextDelta("\n")],
        [ToolCallStart(1, "call_b", "get_time"), ToolCallArguments(1, "{}")]])
    kinds = [(i["type"], i["status"]) for i in items.items]
    assert kinds == [("reasoning", "completed"), ("message", "completed"),
                     ("function_call", "completed"), ("function_call", "completed")]
    assert items.reasoning_text == "Let me think." and items.output_text == "\n\nChecking."
    assert items.items[2]["arguments"] == '{"city": "Paris"}'
    assert items.items[3] == {"id": items.items[3]["id"], "type": "function_call",
                              "status": "completed", "call_id": "call_b", "name": "get_time",
                              "arguments": "{}"}
    names = [e["type"] for e in events]
    assert names[:4] == ["response.output_item.added", "response.content_part.added",
                         "response.reasoning_text.delta", "response.reasoning_text.delta"]
    assert names.count("response.output_item.added") == names.count(
        "response.output_item.done") == 4
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == items.items  # each item's last snapshot is the item as it ended
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] \
        == [0, 1, 2, 3]


def test_whitespace_alone_is_a_message_only_without_calls() -> None:
    items, _ = build([[TextDelta("\n")]], status="incomplete")
    assert [(i["type"], i["status"]) for i in items.items] == [("message", "incomplete")]
    assert items.output_text == "\n"
    items, _ = build([[TextDelta("\n"), ToolCallStart(0, "call_a", "f"),
                       ToolCallArguments(0, "{}"), ToolCallEnd(0), TextDelta(" \n")]])
    assert [i["type"] for i in items.items] == ["function_call"]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_streamed_items_equal_the_whole_texts(chunk: int) -> None:
    """However the text arrives, the items are the same (a real hermes + think parser)."""
    text = ('<think>Plan it.</think>Sure.\n<tool_call>\n{"name": "f", "arguments": '
            '{"a": 1}}\n</tool_call>\nDone.')

    def parser() -> ChatStreamParser:
        return ChatStreamParser(make_reasoning_parser("deepseek_r1", False),
                                make_tool_call_parser("hermes"))

    whole = OutputItems()
    whole.feed(parser().feed(text, is_final=True))
    whole.finish()
    streamed, stream_parser = OutputItems(), parser()
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for k, piece in enumerate(pieces):
        streamed.feed(stream_parser.feed(piece, k == len(pieces) - 1))
    streamed.finish()

    def shape(items: OutputItems) -> list[Any]:
        return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items.items]

    assert shape(streamed) == shape(whole)
    assert [i["type"] for i in whole.items] == ["reasoning", "message", "function_call",
                                               "message"]

"""OpenAI's Responses API (`POST /v1/responses`) on the default model, driven by the official
`openai` SDK's `client.responses`: the response object, streams equal to whole responses, the
same conversation through chat completions, forced tool use checked against the tool's schema,
tool results, structured output, the 1-token probe, and every bad field's error."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_harness import API_KEY, RunningServer
from shared_server import shared_server

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.slow
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "The time in a zone",
     "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                    "required": ["zone"], "additionalProperties": False}}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    return shared_server(request, "--max-model-len", "4096", api_key=API_KEY)  # test_server_api's


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def test_a_response_and_its_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Name three colors.",
                                       max_output_tokens=12, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text and response.output_text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.store is False and response.previous_response_id is None
    again = client.responses.create(model=MODEL, input="Name three colors.",
                                    max_output_tokens=12, temperature=0)
    # the same prompt again: its full blocks come from the prefix cache
    assert again.usage.input_tokens_details.cached_tokens >= 16
    assert again.output_text == response.output_text


def test_a_stream_equals_the_whole_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, input="Write one sentence about the sea.",
                                  instructions="Answer briefly.", max_output_tokens=12,
                                  temperature=0)
    whole = client.responses.create(**kwargs)
    deltas, streamed = [], None
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                streamed = event.response  # (the SDK's final response needs "completed")
    assert streamed is not None
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert streamed.status == whole.status
    assert [i.type for i in streamed.output] == [i.type for i in whole.output]
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_conversation_equals_chat_completions(client: openai.OpenAI) -> None:
    history = [("user", "My name is Ada."), ("assistant", "Nice to meet you, Ada."),
               ("user", "What is my name?")]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               *({"role": r, "content": t} for r, t in history)],
        max_tokens=16, temperature=0)
    items: list[Any] = [{"role": "user", "content": history[0][1]},
                        {"type": "message", "role": "assistant",
                         "content": [{"type": "output_text", "text": history[1][1]}]},
                        {"role": "user", "content": [{"type": "input_text",
                                                      "text": history[2][1]}]}]
    response = client.responses.create(model=MODEL, instructions="Be brief.", input=items,
                                       max_output_tokens=16, temperature=0)
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def function_calls(response: Any) -> list[Any]:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert CALL_ID.fullmatch(call.call_id) and call.id.startswith("fc_")
        assert call.status == "completed"
    return calls


def test_required_calls_follow_the_tools_schemas(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=80, temperature=0)
    assert response.status == "completed"
    calls = function_calls(response)
    assert len(calls) == 1, response.output  # parallel_tool_calls=false: one call at most
    schemas = {tool["name"]: tool["parameters"] for tool in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_named_function_streams_its_arguments(client: openai.OpenAI) -> None:
    arguments = []
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60, temperature=0) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
        response = stream.get_final_response()
    (call,) = function_calls(response)
    assert call.name == "get_weather" and call.arguments == "".join(arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_tool_result_round_trips(client: openai.OpenAI) -> None:
    call_id, arguments = "call_0123456789abcdef01234567", '{"city": "Paris", "unit": "celsius"}'

    def answer(result: str) -> Any:
        return client.responses.create(model=MODEL, tools=TOOLS, tool_choice="none",
                                       max_output_tokens=12, temperature=0, input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call_id, "name": "get_weather",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": call_id, "output": result}])

    short, long = answer("18 C"), answer("18 C, sunny, a light breeze from the west")
    assert long.usage.input_tokens > short.usage.input_tokens  # the result is in the prompt
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
               for tool in TOOLS],
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call_id, "type": "function",
                       "function": {"name": "get_weather", "arguments": arguments}}]},
                  {"role": "tool", "tool_call_id": call_id, "content": "18 C"}])
    assert short.usage.input_tokens == chat.usage.prompt_tokens
    assert short.output_text == (chat.choices[0].message.content or "")


def test_other_tool_types_are_left_out(client: openai.OpenAI) -> None:
    hosted = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "file_search"},
              {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}]
    response = client.responses.create(model=MODEL, input="Say hi.", tools=hosted,
                                       max_output_tokens=4, temperature=0)
    plain = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4,
                                    temperature=0)
    assert response.usage.input_tokens == plain.usage.input_tokens
    assert response.output_text == plain.output_text


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Name a color as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "color", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_one_token_probe(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=1)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 1 and response.output[0].status == "incomplete"
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=1) as stream:
        types = [event.type for event in stream]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"


BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"input": None}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["hi"]}, 400, "input.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type"),
    ({"input": [{"role": "bot", "content": "hi"}]}, 400, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
     400, "input.0.content.0.type"),
    # an image on a text-only model: vLLM's count error, naming the part
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     400, "input.0.content.0.file_id"),
    ({"input": [{"role": "user", "content": 5}]}, 400, "input.0.content"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     400, "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id"),
    ({"tools": [{"type": "web_search"}, {"type": "function", "name": "bad name"}]},
     400, "tools.1.name"),
    ({"tools": [{"type": "web_search"}, *TOOLS[:1], {**TOOLS[1], "name": "get_weather"}]},
     400, "tools.2.name"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, 400, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, 400, "tool_choice"),
    ({"tool_choice": {"type": "web_search"}, "tools": TOOLS}, 400, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     400, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": 2.5}, 400, "temperature"),  # OpenAI's cap here is 2
    ({"top_p": 2}, 400, "top_p"),
    ({"model": "gpt-5"}, 404, "model"),
]


@pytest.mark.parametrize(("fields", "status", "param"), BAD,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_fields_are_named(server: RunningServer, fields: dict[str, Any], status: int,
                              param: str) -> None:
    for stream in (False, True):  # a stream's errors come before its 200, as JSON
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": stream,
                **fields}
        answer = server.post("/v1/responses", body)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert error["param"] == param, error
        assert error["message"]


def test_the_sdk_gets_each_sampling_range_named(client: openai.OpenAI) -> None:
    """The same checks as chat completions (SamplingParams'), plus OpenAI's cap of 2 on
    `temperature`, which chat completions leaves open as vLLM does."""
    for fields in ({"temperature": 9}, {"temperature": -0.5}, {"top_p": 1.5}, {"top_p": 0},
                   {"max_output_tokens": 0}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="hi", **fields)  # type: ignore[call-overload]
        assert refused.value.param == next(iter(fields)), refused.value
    chat = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=9,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content is not None


def test_stateless_refusal_says_what_to_do(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert "stateless" in refused.value.message and "whole conversation" in refused.value.message


def test_the_route_needs_the_key(server: RunningServer) -> None:
    answer = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert answer.status_code == 401 and "error" in answer.json()

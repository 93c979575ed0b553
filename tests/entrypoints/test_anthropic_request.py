"""The Messages API in-process: the body's translation into the neutral chat input, Claude
Code's billing line, the error reshaping (a bug's 500 too) and the stream's error event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from nanoserve.entrypoints.anthropic.billing_header import strip_billing_header
from nanoserve.entrypoints.anthropic.errors import AnthropicErrorShape, reshape_error
from nanoserve.entrypoints.anthropic.messages_request import messages_input
from nanoserve.entrypoints.anthropic.messages_stream import with_error_events
from nanoserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from nanoserve.entrypoints.serving.chat_prompt import message_dicts
from nanoserve.entrypoints.serving.error_handlers import add_error_handlers
from nanoserve.entrypoints.serving.errors import APIError, bad_request, error_body

HEADER = "x-anthropic-billing-header: cc_version=2.1.0.abc; cc_entrypoint=cli; cch=1a2b3;"
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
TOOL = {"name": "get_weather", "description": "Weather", "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


@pytest.mark.parametrize(("texts", "kept"), [
    ([HEADER, "You are Claude Code."], ["You are Claude Code."]),
    ([HEADER + "\nYou are Claude Code."], ["You are Claude Code."]),
    (["You are Claude Code.", HEADER], ["You are Claude Code.", HEADER]),  # only at the start
    (["x-other-header: cch=1;", "Hi"], ["x-other-header: cch=1;", "Hi"]),
    ([], []),
])
def test_the_billing_line_goes_only_from_the_start(texts: list[str], kept: list[str]) -> None:
    assert strip_billing_header(texts) == kept


@pytest.mark.parametrize(("as_string", "as_blocks"), [
    ("You answer in one short sentence.", ["You answer in one short sentence."]),
    ("Be brief.\nUse French.", ["Be brief.", "Use French."]),  # blocks join with a newline
    (f"{HEADER}\nYou are Claude Code.", [HEADER, "You are Claude Code."]),  # billing line off
    (HEADER, [HEADER]),  # nothing but the billing line: no system turn either way
])
def test_system_as_a_string_or_as_blocks_gives_the_same_prompt_ids(
        default_tokenizer: Any, as_string: str, as_blocks: list[str]) -> None:
    """Anthropic documents the two forms as one; Claude Code sends blocks. Both go through one
    renderer: the same chat-template messages, the same ids."""
    def ids(system: Any) -> list[int]:
        chat = messages_input(request(system=system, messages=[{"role": "user",
                                                                 "content": "Hi"}]))
        text = default_tokenizer.apply_chat_template(message_dicts(chat.messages),
                                                     tokenize=False, add_generation_prompt=True)
        return list(default_tokenizer.encode(text, add_special_tokens=False))

    blocks = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
              for text in as_blocks]
    assert ids(as_string) == ids(blocks)
    prompt = default_tokenizer.decode(ids(blocks))
    assert all(text in prompt for text in as_blocks if text != HEADER)  # the blocks' text is in
    assert "x-anthropic-billing-header" not in prompt


def test_a_conversation_translates_turn_by_turn() -> None:
    chat = messages_input(request(
        system=[{"type": "text", "text": HEADER}, {"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.",
                                               "signature": "s"},
                                              {"type": "text", "text": "Checking."}, CALL]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}],
        tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=7, thinking={"type": "disabled"}))
    rendered = message_dicts(chat.messages)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool", "user"]
    assert rendered[0]["content"] == "Be brief."  # the billing line is gone
    assert rendered[2]["content"] == "Checking." and chat.messages[2].reasoning == "Call it."
    assert rendered[2]["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert rendered[3] == {"role": "tool", "content": "18C\nsunny", "tool_call_id": "toolu_1"}
    assert rendered[4]["content"] == "And tomorrow?"
    assert chat.tool_choice == "required" and not chat.is_parallel_tool_calls
    assert chat.tools is not None and chat.tools[0].template == {"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL["input_schema"], "description": "Weather"}}
    assert chat.sampling.stop == ["END"] and chat.sampling.temperature == 0.5
    assert chat.sampling.top_k == 7 and chat.sampling.top_p is None
    assert chat.template.kwargs == {"enable_thinking": False}


def test_the_flag_keeps_the_billing_line() -> None:
    chat = messages_input(request(system=HEADER + "\nBe brief.",
                                  messages=[{"role": "user", "content": "hi"}]),
                          strip_billing=False)
    assert message_dicts(chat.messages)[0]["content"] == HEADER + "\nBe brief."


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choices(choice: dict[str, Any], expected: Any) -> None:
    chat = messages_input(request(messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                                  tool_choice=choice))
    assert chat.tool_choice == expected and chat.is_parallel_tool_calls


def test_thinking_output_format_and_a_prefill() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    asked = request(messages=[{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "Well,"}],
                    thinking={"type": "enabled", "budget_tokens": 2048},
                    output_config={"format": {"type": "json_schema", "schema": schema},
                                   "effort": "low"})
    plain = messages_input(asked)
    assert plain.template.kwargs == {"enable_thinking": True}
    assert plain.sampling.thinking_token_budget is None  # the model has no reasoning tags
    assert messages_input(asked, has_reasoning_tokens=True).sampling.thinking_token_budget == 2048
    assert plain.response_format.response_format == {
        "type": "json_schema", "json_schema": {"name": "output_format", "schema": schema}}
    assert plain.template.continue_final_message and not plain.template.add_generation_prompt
    counted = messages_input(CountTokensRequest.model_validate({
        "model": "m", "messages": asked.model_dump()["messages"],
        "thinking": {"type": "enabled"}}))
    assert counted.template == plain.template  # the same prompt as the request it counts


@pytest.mark.parametrize(("status", "param", "message", "kind", "expected"), [
    (400, "tools.1.function.name", "tool names must be unique", "invalid_request_error",
     "tools.1.name: tool names must be unique"),
    (400, "response_format.json_schema.schema", "response_format.json_schema.schema is not "
     "valid: x", "invalid_request_error", "output_config.format.schema is not valid: x"),
    (400, "stop", "stop must be at most 4 strings", "invalid_request_error",
     "stop_sequences must be at most 4 strings"),
    (404, "model", "The model `x` does not exist.", "not_found_error",
     "The model `x` does not exist."),
    (408, None, "timed out", "timeout_error", "timed out"),
    (413, None, "too big", "request_too_large", "too big"),
    (429, None, "busy", "rate_limit_error", "busy"),
    (500, None, "bug", "api_error", "bug"),
    (503, None, "stopping", "overloaded_error", "stopping"),
])
def test_errors_are_reshaped(status: int, param: str | None, message: str, kind: str,
                             expected: str) -> None:
    reshaped = json.loads(reshape_error(json.dumps(error_body(status, message, param)).encode(),
                                        status))
    assert reshaped == {"type": "error", "error": {"type": kind, "message": expected}}


def test_every_error_on_the_messages_paths_is_anthropic_shaped() -> None:
    app = FastAPI()
    add_error_handlers(app)

    @app.post("/v1/messages/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.post("/v1/messages/refused")
    async def refused() -> None:
        raise bad_request("no", "field")

    @app.post("/v1/chat/refused")
    async def openai_refused() -> None:
        raise bad_request("no", "field")

    app.add_middleware(AnthropicErrorShape)
    client = TestClient(app, raise_server_exceptions=False)
    assert client.post("/v1/messages/boom").json() == {
        "type": "error", "error": {"type": "api_error", "message": "internal error: RuntimeError"}}
    assert client.post("/v1/messages/boom").status_code == 500
    assert client.post("/v1/messages/refused").json()["error"] == {
        "type": "invalid_request_error", "message": "field: no"}
    missing = client.post("/v1/messages/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert client.post("/v1/chat/refused").json()["error"]["param"] == "field"  # OpenAI's


def test_an_error_mid_stream_is_one_error_event() -> None:
    async def events() -> AsyncGenerator[str, None]:
        yield "event: ping\ndata: {\"type\": \"ping\"}\n\n"
        raise APIError(503, "the engine stopped")

    async def read() -> list[str]:
        return [event async for event in with_error_events(events())]

    out = asyncio.run(read())
    assert out[0].startswith("event: ping") and len(out) == 2
    name, data = out[1].strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the engine stopped"}}

"""Anthropic's Messages API on the real server and the default model, driven by the official
`anthropic` SDK: streamed equals whole, forced tool use within each tool's schema, tool results
back in, count_tokens against usage, stop sequences, max_tokens as a cap, errors in Anthropic's
shape with the right status, both kinds of API key, and Claude Code's billing line kept out of
the prefix cache's way.

One server for the file: the default model held to a 1,024-token context (so that max_tokens
past it is cheap to show), one sequence in flight (so that a second is a 429), a small body limit
(so that a 413 is cheap) and an API key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_harness import RunningServer, wait_until

from nanoserve.config import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

KEY = "anthropic-test-key"
MODEL = DEFAULT_MODEL_NAME
CONTEXT = 1024
BODY_LIMIT = 200_000
GREEDY = {"temperature": 0}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
        "required": ["zone"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "The time in a time zone", "input_schema": TIME}]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    server = RunningServer("--max-model-len", str(CONTEXT), "--max-in-flight", "1",
                           "--max-request-body-bytes", str(BODY_LIMIT), api_key=KEY)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def create(client: anthropic.Anthropic, messages: list[dict[str, Any]], max_tokens: int = 24,
           **fields: Any) -> Any:
    return client.messages.create(model=MODEL, max_tokens=max_tokens, messages=messages,
                                  extra_body=GREEDY, **fields)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_size(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens
               + usage.cache_creation_input_tokens)


def fresh(text: str) -> str:
    """A system prompt no earlier request began with: no prefix-cache hits."""
    return f"[{uuid.uuid4().hex}] {text}"


def test_streamed_equals_whole(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Name three colours."}]
    whole = create(client, ask, max_tokens=20)
    with client.messages.stream(model=MODEL, max_tokens=20, messages=ask,
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert whole.id.startswith("msg_") and whole.type == "message"
    assert whole.role == "assistant" and whole.model == MODEL
    assert text_of(whole) and text_of(streamed) == text_of(whole)
    assert streamed.stop_reason == whole.stop_reason in ("end_turn", "max_tokens")
    assert streamed.usage.output_tokens == whole.usage.output_tokens <= 20
    assert prompt_size(streamed.usage) == prompt_size(whole.usage)


def test_count_tokens_is_the_prompt_usage_counts(client: anthropic.Anthropic) -> None:
    system = fresh("You answer in one word.")
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=ASK,
                                           tools=TOOLS).input_tokens
    first = create(client, ASK, max_tokens=4, system=system, tools=TOOLS)
    assert first.usage.input_tokens == counted and first.usage.cache_read_input_tokens == 0
    again = create(client, ASK, max_tokens=4, system=system, tools=TOOLS)
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache served part of it
    assert prompt_size(again.usage) == counted
    assert client.messages.count_tokens(model=MODEL, system=system,
                                        messages=ASK).input_tokens < counted  # tools count


def test_system_blocks_reach_the_prompt_as_the_string_does(client: anthropic.Anthropic) -> None:
    """The same system text as a string and as text blocks: the same prompt, counted and
    served. The second request's `input_tokens` is smaller only because the prefix cache read
    the part the first one wrote (`cache_read_input_tokens`, Anthropic's split)."""
    text = fresh("You answer in one short sentence.")
    hi = [{"role": "user", "content": "Hi"}]
    forms: list[Any] = [text, [{"type": "text", "text": text}]]
    counts = [client.messages.count_tokens(model=MODEL, system=form, messages=hi).input_tokens
              for form in forms]
    usages = [create(client, hi, max_tokens=2, system=form).usage for form in forms]
    assert counts[0] == counts[1] == prompt_size(usages[0]) == prompt_size(usages[1])
    assert usages[0].cache_read_input_tokens == 0 < usages[1].cache_read_input_tokens
    assert usages[1].input_tokens < usages[0].input_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_time"}, {"type": "any"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_use_follows_the_schemas(client: anthropic.Anthropic,
                                             choice: dict[str, Any]) -> None:
    message = create(client, ASK, max_tokens=120, tools=TOOLS, tool_choice=choice)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use", message
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
        assert call.id
    if choice["type"] == "tool":
        assert [call.name for call in calls] == ["get_time"]
    if choice.get("disable_parallel_tool_use"):
        assert len(calls) == 1


def test_tool_results_go_back_to_the_model(client: anthropic.Anthropic) -> None:
    message = create(client, ASK, max_tokens=60, tools=TOOLS,
                     tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = [block for block in message.content if block.type == "tool_use"]

    def conversation(result: str) -> list[dict[str, Any]]:
        return [*ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": result}]}]

    result = "It is 18 degrees and sunny in Paris, with a light wind from the west."
    answer = create(client, conversation(result), max_tokens=16, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=conversation(result),
                                           tools=TOOLS).input_tokens
    assert prompt_size(answer.usage) == counted
    without = client.messages.count_tokens(model=MODEL, messages=conversation(""),
                                           tools=TOOLS).input_tokens
    assert counted - without >= 14  # the result's ~16 tokens are in the prompt


def test_stop_sequences_cut_exactly(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Write a sentence about the sea."}]
    full = text_of(create(client, ask, max_tokens=24))
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = create(client, ask, max_tokens=24, stop_sequences=["@@never@@", stop])
    assert text_of(cut) == full[:full.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ask, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(cut)
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop


def test_max_tokens_past_the_context_is_a_cap(client: anthropic.Anthropic) -> None:
    filler = "one two three four five six seven eight nine ten " * 96
    ask = [{"role": "user", "content": filler + "Go on counting."}]
    # Claude Code's ask (streamed, as Claude Code does: the SDK streams anything this long)
    with client.messages.stream(model=MODEL, max_tokens=32000, messages=ask,
                                extra_body=GREEDY) as stream:
        message = stream.get_final_message()
    size = prompt_size(message.usage)
    assert CONTEXT - 80 < size < CONTEXT, size
    assert 0 < message.usage.output_tokens <= CONTEXT - size
    if message.usage.output_tokens == CONTEXT - size:
        assert message.stop_reason == "max_tokens"


def test_billing_header_does_not_defeat_the_prefix_cache(client: anthropic.Anthropic) -> None:
    rules = " ".join(f"Rule {i}: keep answers short and plain." for i in range(45))
    instructions = f"You are an interactive CLI tool. Session {uuid.uuid4().hex}. {rules}"

    def claude_code_request(first_line: str) -> Any:
        system = [{"type": "text", "text": first_line},
                  {"type": "text", "text": "You are Claude Code, Anthropic's official CLI."},
                  {"type": "text", "text": instructions,
                   "cache_control": {"type": "ephemeral"}}]
        return create(client, [{"role": "user", "content": "hi"}], max_tokens=2,
                      system=system, metadata={"user_id": "test"})

    header = "x-anthropic-billing-header: cc_version=2.1.0.abc; cc_entrypoint=cli; cch={};"
    first = claude_code_request(header.format("1a2b3"))
    second = claude_code_request(header.format("9f8e7"))
    assert first.usage.cache_read_input_tokens < 0.1 * prompt_size(first.usage)
    assert prompt_size(second.usage) > 400
    assert second.usage.cache_read_input_tokens >= 0.7 * prompt_size(second.usage), second.usage
    # the control: a changed first line that is not the billing line defeats the cache
    other = claude_code_request("x-session-header: cch=5d6c7;")
    assert other.usage.cache_read_input_tokens < 0.1 * prompt_size(other.usage)


# -- errors ------------------------------------------------------------------------------

GOOD: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": ASK}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
SEARCH = {"name": "search", "description": "Search the web", "input_schema": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
    "required": ["query"], "additionalProperties": False}}
TOOL_SETS = [TOOLS[1:], TOOLS, [*TOOLS, SEARCH]]
RUNS = [(0.0, 0), (0.8, 0), (0.8, 1), (0.8, 2)]  # (temperature, seed)


@pytest.mark.parametrize("tools", TOOL_SETS, ids=["1-tool", "2-tools", "3-tools"])
def test_forced_tool_lists_end_with_tool_use_and_no_repeats(server: RunningServer,
                                                            client: anthropic.Anthropic,
                                                            tools: list[dict[str, Any]]) -> None:
    """The default model, forced to call (Anthropic's `any` and a named tool, chat
    completions' `required`): every answer ends with its calls (`tool_use`, `tool_calls`), each
    within its tool's schema, none an exact repeat of another. Unchecked, this model at
    temperature 0 wrote one `search` call three times."""
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    schemas = {tool["name"]: tool["input_schema"] for tool in tools}
    openai_client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    openai_tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in tools]
    for temperature, seed in RUNS:
        sampling = {"temperature": temperature, "seed": seed}
        runs: list[tuple[str, list[tuple[str, Any]]]] = []
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
            message = client.messages.create(model=MODEL, max_tokens=200, messages=ask,
                                             tools=tools, tool_choice=choice,
                                             extra_body=sampling)
            runs.append((message.stop_reason or "", [(b.name, b.input) for b in message.content
                                                     if b.type == "tool_use"]))
        chat = openai_client.chat.completions.create(
            model=MODEL, max_tokens=200, messages=ask, tools=openai_tools,
            tool_choice="required", temperature=temperature, seed=seed)
        runs.append((chat.choices[0].finish_reason.replace("tool_calls", "tool_use"),
                     [(c.function.name, json.loads(c.function.arguments))
                      for c in chat.choices[0].message.tool_calls or []]))
        for reason, calls in runs:
            assert reason == "tool_use" and calls, (sampling, runs)
            for name, arguments in calls:
                jsonschema.validate(arguments, schemas[name])
            as_json = [json.dumps(call) for call in calls]
            assert len(set(as_json)) == len(as_json), (sampling, calls)


CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def body(**changes: Any) -> dict[str, Any]:
    out = {**GOOD, **changes}
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize(("sent", "status", "kind", "fragment"), [
    (body(max_tokens=None), 400, "invalid_request_error", "max_tokens: Field required"),
    (body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (body(messages=[]), 400, "invalid_request_error", "messages"),
    (body(messages=[{"role": "wizard", "content": "hi"}]), 400, "invalid_request_error",
     "messages.0.role"),
    (body(messages=[{"role": "user", "content": [IMAGE]}]), 400, "invalid_request_error",
     "messages.0.content.0: At most 0 image(s) may be provided in one prompt."),
    (body(messages=[{"role": "user", "content": [{**IMAGE, "source": {
        **IMAGE["source"], "media_type": "image/bmp"}}]}]), 400, "invalid_request_error",
     "messages.0.content.0.source.media_type: 'image/bmp' is not supported"),
    (body(messages=[{"role": "user", "content": [{"type": "video"}]}]), 400,
     "invalid_request_error", "messages.0.content.0"),
    (body(messages=[*ASK, {"role": "assistant", "content": [{**CALL, "input": None}]}]), 400,
     "invalid_request_error", "messages.1.content.0.tool_use.input"),
    (body(messages=[*ASK, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "18C"}]}]), 400,
     "invalid_request_error", "messages.2.content.0.tool_use_id: 'toolu_2' answers no"),
    (body(messages=[*ASK, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "document", "source": {}}]}]}]), 400, "invalid_request_error",
     "messages.2.content.0.content.0: document blocks"),
    (body(tools=[{"name": "f"}]), 400, "invalid_request_error", "tools.0.input_schema"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error", "'web_search_20250305' is one of Anthropic's server tools"),
    (body(tools=[TOOLS[0], TOOLS[0]]), 400, "invalid_request_error", "tools.1.name"),
    (body(tools=TOOLS, tool_choice={"type": "tool"}), 400, "invalid_request_error",
     "needs the name"),
    (body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), 400,
     "invalid_request_error", "'nope', which is not in tools"),
    (body(tools=TOOLS, tool_choice={"type": "sometimes"}), 400, "invalid_request_error",
     "tool_choice.type"),
    (body(tool_choice={"type": "any"}), 400, "invalid_request_error", "tools must be set"),
    (body(tools=[{"name": "f", "input_schema": {"type": "nonsense"}}],
          tool_choice={"type": "any"}), 400, "invalid_request_error", "tools.0.input_schema"),
    (body(temperature=-1), 400, "invalid_request_error", "temperature"),
    (body(temperature=1.5), 400, "invalid_request_error", "temperature must be in [0, 1]"),
    (body(seed=2**64), 400, "invalid_request_error", "seed"),
    (body(top_p=2), 400, "invalid_request_error", "top_p"),
    (body(top_k="many"), 400, "invalid_request_error", "top_k"),
    (body(stop_sequences="END"), 400, "invalid_request_error", "stop_sequences"),
    (body(stop_sequences=["x" * 5000]), 400, "invalid_request_error", "stop_sequences"),
    (body(thinking={"type": "sometimes"}), 400, "invalid_request_error", "thinking.type"),
    (body(output_config={"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}),
     400, "invalid_request_error", "output_config.format.schema"),
    (body(messages=[{"role": "user", "content": "word " * 1100}]), 400,
     "invalid_request_error", "maximum context length is 1024 tokens"),
    (body(model="claude-opus-4"), 404, "not_found_error", "claude-opus-4"),
])
def test_bad_requests_get_anthropic_errors(server: RunningServer, sent: dict[str, Any],
                                           status: int, kind: str, fragment: str) -> None:
    response = httpx.post(server.url + "/v1/messages?beta=true", json=sent, timeout=60,
                          headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                   "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert_anthropic_error(response, status, kind, fragment)


@pytest.mark.parametrize(("sent", "status", "kind", "fragment"), [
    ({"model": MODEL}, 400, "invalid_request_error", "messages: Field required"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [IMAGE]}]}, 400,
     "invalid_request_error", "messages.0.content.0: At most 0 image(s)"),
    ({"model": "claude-haiku-4-5", "messages": ASK}, 404, "not_found_error", "claude-haiku"),
])
def test_count_tokens_errors_too(server: RunningServer, sent: dict[str, Any], status: int,
                                 kind: str, fragment: str) -> None:
    response = httpx.post(server.url + "/v1/messages/count_tokens", json=sent, timeout=60,
                          headers={"authorization": f"Bearer {KEY}"})
    assert_anthropic_error(response, status, kind, fragment)


def assert_anthropic_error(response: httpx.Response, status: int, kind: str,
                           fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    assert set(error["error"]) == {"type", "message"} and error["error"]["type"] == kind, error
    assert fragment in error["error"]["message"], error


def test_the_sdk_raises_the_matching_errors(server: RunningServer,
                                            client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        create(client, [{"role": "user", "content": [IMAGE]}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    for field, value in (("temperature", 1.5), ("top_p", 0), ("top_k", -2)):
        with pytest.raises(anthropic.BadRequestError, match=field):
            client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                                   extra_body={field: value})


def test_either_kind_of_key_is_accepted(server: RunningServer) -> None:
    by_header = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    by_bearer = anthropic.Anthropic(base_url=server.url, api_key=None, auth_token=KEY,
                                    max_retries=0)
    for client in (by_header, by_bearer):
        assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
        assert create(client, ASK, max_tokens=2).usage.output_tokens > 0
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        response = httpx.post(server.url + "/v1/messages", json=GOOD, headers=headers)
        assert_anthropic_error(response, 401, "authentication_error", "x-api-key")
    # the OpenAI routes take the x-api-key header too, and keep their own error shape
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert "error" in httpx.get(server.url + "/v1/models").json()


def test_a_body_past_the_limit_is_413(server: RunningServer) -> None:
    big = body(messages=[{"role": "user", "content": "a" * BODY_LIMIT}])
    response = httpx.post(server.url + "/v1/messages", json=big, headers={"x-api-key": KEY})
    assert_anthropic_error(response, 413, "request_too_large", "--max-request-body-bytes")


def test_past_the_in_flight_limit_is_429(server: RunningServer,
                                         client: anthropic.Anthropic) -> None:
    long_answer = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    with client.messages.stream(model=MODEL, max_tokens=400, messages=long_answer) as stream:
        next(iter(stream))  # message_start: the request is in the engine
        with pytest.raises(anthropic.RateLimitError) as limited:
            create(client, ASK, max_tokens=2)
        assert limited.value.status_code == 429
        assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]

    def admitted() -> bool:
        try:
            return bool(create(client, ASK, max_tokens=1))
        except anthropic.RateLimitError:
            return False

    wait_until(admitted, "the aborted stream to leave the engine")

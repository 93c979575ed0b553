"""Reasoning effort and structured outputs after the reasoning, through the real server and the
official clients, on a tiny random Qwen3 with `<think>` tokens and `--reasoning-parser qwen3`
(its template opens the reasoning section; a random model never closes it by itself, so every
section here ends where its budget forced `</think>`).

- Each API's effort (chat's `reasoning_effort`, Responses' `reasoning.effort`, Messages'
  `output_config.effort`, Ollama's `think` level) is a thinking budget: the section is exactly
  the documented number of tokens; `none` closes it in the template.
- A JSON schema (chat's `response_format`, Responses' `text.format`, Messages'
  `output_config.format`, Ollama's `format`) holds only after the reasoning: the reasoning is
  free text longer than any answer the schema allows, and the content validates, streamed and
  whole.
- Without a reasoning parser the effort is accepted and changes nothing; an unknown one is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from server_harness import RunningServer
from shared_server import shared_server

from nanoserve.entrypoints.serving.reasoning_options import EFFORT_BUDGETS

MODEL = "tiny-thinker"
ASK = [{"role": "user", "content": "Is seven a prime? Answer in JSON."}]
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
LONGEST_ANSWER = 120  # characters: `{"ok": false, "n": 99}` with every run of whitespace allowed
SEEDED = {"temperature": 1.0, "seed": 11}


@pytest.fixture(scope="module")
def server(tiny_reasoning_model_dir: Path) -> Iterator[RunningServer]:
    # the high budgets need a context past the tiny model's 1,024 positions (random weights)
    server = RunningServer(str(tiny_reasoning_model_dir), "--served-model-name", MODEL,
                           "--reasoning-parser", "qwen3", "--max-model-len", "2048",
                           env={"NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    yield server
    assert server.stop() == 0


def reasoning_tokens(choice: Any) -> int:
    """Output tokens before `</think>`, from the choice's logprobs (one entry per token)."""
    tokens = [entry.token for entry in choice.logprobs.content]
    assert "</think>" in tokens, "the section never closed"
    return tokens.index("</think>")


def test_reasoning_effort_is_a_thinking_budget(server: RunningServer) -> None:
    client = server.client()
    asked = dict(model=MODEL, messages=ASK, max_tokens=1100, logprobs=True, **SEEDED)
    low = client.chat.completions.create(reasoning_effort="low", **asked).choices[0]
    assert reasoning_tokens(low) == EFFORT_BUDGETS["low"] == 1024
    # (the others stop a few hundred tokens in: a random model's answer runs to max_tokens)
    minimal = client.chat.completions.create(reasoning_effort="minimal",
                                             **{**asked, "max_tokens": 300}).choices[0]
    assert reasoning_tokens(minimal) == EFFORT_BUDGETS["minimal"] == 256
    assert minimal.message.content  # the answer follows the forced `</think>`
    # the request's own budget wins over its effort
    own = client.chat.completions.create(reasoning_effort="low", **{**asked, "max_tokens": 40},
                                         extra_body={"thinking_token_budget": 8}).choices[0]
    assert reasoning_tokens(own) == 8
    # without an effort nothing stops the section: the whole output is reasoning, past the
    # smallest budget
    free = client.chat.completions.create(**{**asked, "max_tokens": 300}).choices[0]
    assert "</think>" not in [entry.token for entry in free.logprobs.content]
    assert free.message.content is None and free.finish_reason == "length"
    # none: the template closes the section (enable_thinking=False), all is content
    off = client.chat.completions.create(reasoning_effort="none", **{**asked,
                                                                    "max_tokens": 20})
    assert off.choices[0].message.model_extra["reasoning"] is None
    assert off.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of") as bad:
        client.chat.completions.create(reasoning_effort="extreme", **asked)  # type: ignore[arg-type]
    assert bad.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_responses_messages_and_ollama_efforts(server: RunningServer) -> None:
    response = server.client().responses.create(
        model=MODEL, input="Is seven a prime?", reasoning={"effort": "minimal"},
        max_output_tokens=300, temperature=1.0)
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == 256
    with pytest.raises(openai.BadRequestError, match=r"reasoning\.effort") as bad:
        server.client().responses.create(model=MODEL, input="hi",
                                         reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]
    assert bad.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    message = anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
        model=MODEL, max_tokens=1100, messages=ASK,  # type: ignore[arg-type]
        output_config={"effort": "low"}, extra_body={"temperature": 1.0, "seed": 3})
    # the budget closed the thinking (nothing else would), and the answer followed
    assert [block.type for block in message.content] == ["thinking", "text"]
    with pytest.raises(anthropic.BadRequestError, match=r"output_config\.effort"):
        anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
            model=MODEL, max_tokens=30, messages=ASK,  # type: ignore[arg-type]
            output_config={"effort": "huge"})  # type: ignore[typeddict-item]
    reply = ollama.Client(host=server.url).chat(
        model=MODEL, messages=ASK, think="low", format=SCHEMA,
        options={"num_predict": 1200, "seed": 4, "temperature": 1.0})
    assert reply.message.thinking and len(reply.message.thinking) > LONGEST_ANSWER
    jsonschema.validate(json.loads(reply.message.content or ""), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_holds_after_free_reasoning_on_chat(server: RunningServer,
                                                     stream: bool) -> None:
    asked: dict[str, Any] = dict(
        model=MODEL, messages=ASK, max_tokens=400, reasoning_effort="minimal",
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA}}, **SEEDED)
    client = server.client()
    if stream:
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **asked):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning") or ""
                content += delta.content or ""
    else:
        message = client.chat.completions.create(**asked).choices[0].message
        reasoning, content = message.model_extra["reasoning"], message.content or ""
    assert_free_reasoning_then_answer(reasoning, content)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_holds_after_free_reasoning_on_responses(server: RunningServer,
                                                          stream: bool) -> None:
    asked: dict[str, Any] = dict(
        model=MODEL, input="Is seven a prime?", reasoning={"effort": "minimal"},
        max_output_tokens=400, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    client = server.client()
    if stream:
        events = list(client.responses.create(stream=True, **asked))
        response = events[-1].response  # response.completed carries the whole response
    else:
        response = client.responses.create(**asked)
    reasoning = "".join(part.text for item in response.output if item.type == "reasoning"
                        for part in item.content or ())
    assert_free_reasoning_then_answer(reasoning, response.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_holds_after_free_reasoning_on_messages_and_ollama(server: RunningServer,
                                                                    stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none")
    asked: dict[str, Any] = dict(
        model=MODEL, max_tokens=400, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 200},
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        extra_body={"temperature": 1.0, "seed": 5})
    if stream:
        with client.messages.stream(**asked) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**asked)
    thinking = "".join(block.thinking for block in message.content if block.type == "thinking")
    text = "".join(block.text for block in message.content if block.type == "text")
    assert_free_reasoning_then_answer(thinking, text)
    # Ollama's format with a think level
    ollama_client = ollama.Client(host=server.url)
    options = {"num_predict": 400, "seed": 6, "temperature": 1.0}
    if stream:
        thinking = content = ""
        for part in ollama_client.chat(model=MODEL, messages=ASK, think="low", format=SCHEMA,
                                       options={**options, "num_predict": 1200}, stream=True):
            thinking += part.message.thinking or ""
            content += part.message.content or ""
    else:
        reply = ollama_client.generate(model=MODEL, prompt="Is seven a prime?", think="low",
                                       format=SCHEMA, options={**options, "num_predict": 1200})
        thinking, content = reply.thinking or "", reply.response
    assert_free_reasoning_then_answer(thinking, content)


def assert_free_reasoning_then_answer(reasoning: str, content: str) -> None:
    """The reasoning is longer than any text the schema allows (no grammar held it), and the
    content is a valid answer."""
    assert len(reasoning) > LONGEST_ANSWER, reasoning
    with pytest.raises(json.JSONDecodeError):
        json.loads(reasoning)
    jsonschema.validate(json.loads(content), SCHEMA)


def test_without_a_reasoning_parser_an_effort_changes_nothing(
        request: pytest.FixtureRequest) -> None:
    """Codex sends an effort with every request: the default model (no parser) answers it as
    it answers the same request without one; only an unknown effort is refused."""
    server = shared_server(request)
    client = server.client()
    asked = dict(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=16, temperature=0.0)
    plain = client.chat.completions.create(**asked).choices[0].message.content
    for effort in ("none", "high"):
        with_effort = client.chat.completions.create(reasoning_effort=effort, **asked)  # type: ignore[arg-type]
        assert with_effort.choices[0].message.content == plain
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                        json={**asked, "reasoning_effort": "max"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "reasoning_effort"


TOOLS = [{"type": "function", "function": {
    "name": "count", "description": "Count to n",
    "parameters": {"type": "object",
                   "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["n"], "additionalProperties": False}}}]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "count"}}])
def test_forced_tool_calls_follow_free_reasoning(server: RunningServer,
                                                 tool_choice: Any) -> None:
    """A tool grammar (tool_choice required or named) starts where the reasoning ends too:
    the reasoning comes back as reasoning, the calls as calls."""
    message = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=600,
        reasoning_effort="minimal", **SEEDED).choices[0].message
    assert len(message.model_extra["reasoning"]) > LONGEST_ANSWER
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.function.name == "count"
        assert 0 <= json.loads(call.function.arguments)["n"] <= 9

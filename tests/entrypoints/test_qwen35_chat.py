"""Qwen3.5 chat as a user sees it: the real server on a tiny random checkpoint that carries
Qwen3.5's own tokenizer and chat template (tests/model/qwen35_checkpoints.py), driven by the
official `openai` SDK, with `--tool-call-parser qwen3_coder --reasoning-parser qwen3`.

- Tools: the template renders them and the XML call format into the system turn; the model's
  `<tool_call><function=...><parameter=...>` output comes back as `message.tool_calls` with
  JSON arguments typed by the tool's schema, streamed or not; the call and a `tool` result go
  back through the template (`<tool_response>`) for a second turn.
- Reasoning: with thinking on (the template opens `<think>`) the reasoning is its own field,
  apart from the content; `chat_template_kwargs={"enable_thinking": False}` gives none.

How random weights are made to think briefly and call a tool: `thinking_token_budget` forces
`</think>` after BUDGET tokens, and a Lark grammar (`structured_outputs`), which holds only
after the reasoning, forces the XML call with `<tool_call>` and `</tool_call>` as the single
tokens Qwen3.5 writes; the city and the days are the model's own draws. (A regex spelling
`</tool_call>` out does not do: llguidance then allows only that added token and refuses it.)

Each test runs on a Qwen3 and on a Qwen3.5 (Gated DeltaNet hybrid) checkpoint.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from qwen35_checkpoints import write_tiny_qwen35
from qwen35_tokenizer import qwen35_special_tokens

MODEL = "tiny-qwen35"
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False,
                      "required": ["city", "days"],
                      "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
SYSTEM = "Answer briefly."
QUESTION = "What is the weather in Paris?"
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
BUDGET = 4  # reasoning tokens before the forced `</think>`
SEEDED: dict[str, Any] = {"temperature": 0.8, "seed": 7}
SPECIAL = qwen35_special_tokens()
# the call Qwen3.5 writes after its reasoning, the tags as their single tokens
CALL_GRAMMAR = (
    f'start: "\\n\\n" <[{SPECIAL["<tool_call>"]}]> "\\n<function=get_weather>\\n<parameter=city>'
    '\\n" CITY "\\n</parameter>\\n<parameter=days>\\n" DAYS "\\n</parameter>\\n</function>\\n" '
    f'<[{SPECIAL["</tool_call>"]}]>\n'
    'CITY: "Paris" | "Oslo"\n'
    "DAYS: /[1-7]/\n")
CALLING: dict[str, Any] = {"thinking_token_budget": BUDGET,
                           "structured_outputs": {"grammar": CALL_GRAMMAR}}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`nanoserve serve` on the tiny checkpoint of the family (`qwen3` or `qwen3_5`)."""
    path = write_tiny_qwen35(tmp_path_factory.mktemp(f"tiny-{request.param}-chat"),
                             family=request.param)
    server = RunningServer(str(path), "--served-model-name", MODEL, "--tool-call-parser",
                           "qwen3_coder", "--reasoning-parser", "qwen3")
    yield server
    assert server.stop() == 0


def rendered(server: RunningServer, messages: list[dict[str, Any]],
             **fields: Any) -> tuple[list[int], str]:
    """The prompt's ids and text, as the server renders the messages for a chat request."""
    response = server.post("/tokenize", {"messages": messages, **fields})
    assert response.status_code == 200, response.text
    ids = response.json()["tokens"]
    return ids, server.post("/detokenize", {"tokens": ids}).json()["prompt"]


def streamed(server: RunningServer, **asked: Any) -> tuple[str, str, list[dict[str, str]],
                                                            str | None]:
    """(reasoning, content, calls, finish_reason) of the request, streamed."""
    reasoning = content = ""
    calls: list[dict[str, str]] = []
    finish = None
    for chunk in server.client().chat.completions.create(stream=True, **asked):
        if not chunk.choices:
            continue
        (choice,) = chunk.choices
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert CALL_ID.fullmatch(piece.id) and piece.index == len(calls)
                calls.append({"name": piece.function.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_tools_are_rendered_in_qwen35s_format(server: RunningServer) -> None:
    ids, prompt = rendered(server, ASK, tools=TOOLS)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following "
                             "functions:\n\n<tools>\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == TOOLS
    assert ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
            "value_1\n</parameter>") in system
    assert system.endswith(f"</IMPORTANT>\n\n{SYSTEM}")  # the system message after the tools
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
                           "<|im_start|>assistant\n<think>\n")
    # the template's tags are the tokenizer's single tokens
    assert ids[0] == SPECIAL["<|im_start|>"] and ids[-2] == SPECIAL["<think>"]
    assert SPECIAL["<tool_call>"] in ids and SPECIAL["</tool_call>"] in ids


def test_a_tool_call_and_its_result_round_trip(server: RunningServer) -> None:
    asked: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                 extra_body=CALLING, **SEEDED)
    (choice,) = server.client().chat.completions.create(**asked).choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    (call,) = message.tool_calls
    assert CALL_ID.fullmatch(call.id) and call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)  # `days` typed an integer by the schema
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.model_extra["reasoning"] == reasoning
    assert not re.search(r"</?think>|<tool_call>", reasoning)
    assert (message.content or "").strip() == ""  # Qwen3.5's "\n\n" before the call at most
    assert streamed(server, **asked) == (reasoning, message.content or "", [
        {"name": "get_weather", "arguments": call.function.arguments}], "tool_calls")

    history: list[dict[str, Any]] = [
        *ASK, {"role": "assistant", "content": message.content,
               "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    ids, prompt = rendered(server, history, tools=TOOLS)
    assert prompt.endswith(
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{arguments['city']}\n"
        f"</parameter>\n<parameter=days>\n{arguments['days']}\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    answered: dict[str, Any] = dict(model=MODEL, messages=history, tools=TOOLS, max_tokens=8,
                                    extra_body={"thinking_token_budget": 2}, **SEEDED)
    answer = server.client().chat.completions.create(**answered)  # a 200, else it raises
    assert answer.usage.prompt_tokens == len(ids)  # the prompt /tokenize showed
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.model_extra["reasoning_content"]


def test_reasoning_is_apart_from_the_answer_unless_thinking_is_off(
        server: RunningServer) -> None:
    asked: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=10, logprobs=True,
                                 extra_body={"thinking_token_budget": BUDGET}, **SEEDED)
    (choice,) = server.client().chat.completions.create(**asked).choices
    tokens = [entry.token for entry in choice.logprobs.content]
    assert tokens.index("</think>") == BUDGET  # the budget closed the section
    reasoning, content = choice.message.model_extra["reasoning_content"], choice.message.content
    assert reasoning and content and choice.message.model_extra["reasoning"] == reasoning
    assert not re.search(r"</?think>", reasoning + content)
    del asked["logprobs"]
    assert streamed(server, **asked)[:2] == (reasoning, content)

    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert rendered(server, ASK, **off)[1].endswith("<|im_start|>assistant\n<think>\n\n"
                                                    "</think>\n\n")
    (plain,) = server.client().chat.completions.create(
        **{**asked, "max_tokens": 6, "extra_body": off}).choices
    assert plain.message.model_extra["reasoning_content"] is None
    assert plain.message.model_extra["reasoning"] is None
    assert plain.message.content and "</think>" not in plain.message.content


def test_a_calls_reasoning_goes_back_through_the_template(server: RunningServer) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}
    history: list[dict[str, Any]] = [
        *ASK, {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
               "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5 degrees"}]
    prompt = rendered(server, history, tools=TOOLS)[1]
    assert "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>" in prompt

"""gpt-oss chat as a user sees it: the real server on a tiny random gpt-oss that carries the real
o200k_harmony tokenizer and llama.cpp's gpt-oss chat template (nanoserve/bench/o200k_harmony.py),
with no parser flags (the template chooses `openai` and `openai_gptoss`), driven by the official
`openai`, `anthropic` and `ollama` SDKs (chat completions, Messages, Responses, Ollama's chat).

The `ScriptedByDefault` logits processor (scripted_output.py) makes the random model write a
given harmony text token by token through the real engine, each format token one id (a call,
where a request names no text: Responses and Ollama carry no `extra_args`). What comes back:
the analysis channel as reasoning, a `functions.*` message as a call (finish `tool_calls`), the
final channel as content; `<|end|>` between messages does not stop the output, `<|call|>` and
`<|return|>` do; effort low and high change the system message; a response format constrains
only the final message.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import pytest
from scripted_chat import script_ids, scripted, scripted_server
from server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from gpt_oss_checkpoints import write_tiny_gpt_oss

from nanoserve.bench.o200k_harmony import HARMONY_VOCAB_SIZE, harmony_tokenizer_dir
from nanoserve.entrypoints.responses.items import OutputItems
from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.tool_calls import make_tool_call_parser

MODEL = "tiny-gpt-oss"
FORMAT_IDS = {"<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005,
              "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}
STOP_IDS = (FORMAT_IDS["<|return|>"], FORMAT_IDS["<|call|>"])
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
MARKUP = re.compile(r"<\|[a-z]+\|>")
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "Need the weather."
ARGUMENTS = '{"city": "Paris, \\"FR\\""}'
CALL_OUTPUT = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>"
               "commentary to=functions.get_weather <|constrain|>json<|message|>"
               f"{ARGUMENTS}<|call|>")
ANSWER_OUTPUT = ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>It is sunny.<|return|>")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Any]]:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    write_tiny_gpt_oss(path, vocab_size=HARMONY_VOCAB_SIZE, bos_token_id=199998,
                       eos_token_id=200002, pad_token_id=199999)
    for file in harmony_tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    call_ids = script(tokenizer, CALL_OUTPUT)["extra_args"]["scripted_token_ids"]
    with scripted_server(path, "--served-model-name", MODEL, processor="ScriptedByDefault",
                         env={"SCRIPTED_TOKEN_IDS": ",".join(map(str, call_ids))}) as server:
        yield server, tokenizer


@pytest.fixture(scope="module")
def server(served: tuple[RunningServer, Any]) -> RunningServer:
    return served[0]


@pytest.fixture(scope="module")
def tokenizer(served: tuple[RunningServer, Any]) -> Any:
    return served[1]


def script(tokenizer: Any, text: str) -> dict[str, Any]:
    """`extra_args` that make the model write `text` (which ends in a stop token)."""
    return scripted(script_ids(lambda t: tokenizer.encode(t, add_special_tokens=False), text,
                               FORMAT_IDS, STOP_IDS))


def chat(server: RunningServer, tokenizer: Any, output: str, **asked: Any) -> Any:
    fields = {"model": MODEL, "messages": ASK, "max_tokens": 100, **asked}
    return server.client().chat.completions.create(extra_body=script(tokenizer, output),
                                                   **fields)


def whole(server: RunningServer, tokenizer: Any, output: str, **asked: Any) -> tuple[Any, ...]:
    """(reasoning, content, calls, finish_reason), not streamed."""
    response = chat(server, tokenizer, output, **asked)
    # the output is the script, ended by its stop token: `<|end|>` inside did not stop it
    assert response.usage.completion_tokens \
        == len(script(tokenizer, output)["extra_args"]["scripted_token_ids"])
    assert not MARKUP.search(response.model_dump_json())
    (choice,) = response.choices
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert all(CALL_ID.fullmatch(c.id) for c in message.tool_calls or [])
    return message.model_extra["reasoning_content"], message.content, calls, \
        choice.finish_reason


def streamed(server: RunningServer, tokenizer: Any, output: str,
             **asked: Any) -> tuple[Any, ...]:
    reasoning = content = ""
    calls: list[tuple[str, str]] = []
    finish = None
    for chunk in chat(server, tokenizer, output, stream=True, **asked):
        if not chunk.choices:
            continue
        (choice,) = chunk.choices
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                calls.append((piece.function.name, ""))
            calls[piece.index] = (calls[piece.index][0],
                                  calls[piece.index][1] + (piece.function.arguments or ""))
        finish = choice.finish_reason or finish
    return reasoning or None, content or None, calls, finish


def rendered(server: RunningServer, messages: list[dict[str, Any]], **asked: Any) -> str:
    response = server.post("/v1/chat/completions/render",
                           {"model": MODEL, "messages": messages, **asked})
    assert response.status_code == 200, response.text
    ids = response.json()["token_ids"]
    return str(server.post("/detokenize", {"tokens": ids}).json()["prompt"])


def test_a_thought_and_a_call(server: RunningServer, tokenizer: Any) -> None:
    expected = (THOUGHT, None, [("get_weather", ARGUMENTS)], "tool_calls")
    assert whole(server, tokenizer, CALL_OUTPUT, tools=TOOLS) == expected
    assert streamed(server, tokenizer, CALL_OUTPUT, tools=TOOLS) == expected


def test_an_answer_after_reasoning_and_effort_in_the_prompt(server: RunningServer,
                                                           tokenizer: Any) -> None:
    expected: tuple[Any, ...] = ("Done.", "It is sunny.", [], "stop")
    assert whole(server, tokenizer, ANSWER_OUTPUT) == expected
    assert streamed(server, tokenizer, ANSWER_OUTPUT) == expected
    low = rendered(server, ASK, reasoning_effort="low")
    high = rendered(server, ASK, reasoning_effort="high")
    assert "Reasoning: low\n" in low and "Reasoning: high\n" in high
    assert low.replace("Reasoning: low", "Reasoning: high") == high
    assert low.endswith("<|start|>user<|message|>What is the weather in Paris?<|end|>"
                        "<|start|>assistant")


def test_the_call_goes_back_with_its_thinking(server: RunningServer, tokenizer: Any) -> None:
    (first,) = chat(server, tokenizer, CALL_OUTPUT, tools=TOOLS).choices
    (call,) = first.message.tool_calls
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
                      "reasoning_content": first.message.model_extra["reasoning_content"]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    prompt = rendered(server, history, tools=TOOLS)
    assert prompt.endswith(
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        + json.dumps(json.loads(ARGUMENTS)) + "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"'
        "<|end|><|start|>assistant")
    bad = [*ASK, {"role": "assistant", "content": "<|channel|>final<|message|>x"}, *ASK]
    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": bad})
    assert response.status_code == 400 and "messages.1.content" in response.text


def test_a_response_format_constrains_the_final_message(server: RunningServer,
                                                        tokenizer: Any) -> None:
    output = ("<|channel|>analysis<|message|>Plain thoughts {<|end|><|start|>assistant"
              '<|channel|>final<|message|>{"city": "Oslo"}<|return|>')
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": TOOLS[0][
        "function"]["parameters"]}}
    assert whole(server, tokenizer, output, response_format=schema) \
        == ("Plain thoughts {", '{"city": "Oslo"}', [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages_give_thinking_then_tool_use(server: RunningServer, tokenizer: Any,
                                                        stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    fields: dict[str, Any] = {
        "model": MODEL, "max_tokens": 100, "messages": ASK,
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "extra_body": script(tokenizer, CALL_OUTPUT)}
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    thinking, tool_use = message.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking == THOUGHT
    assert isinstance(tool_use, anthropic.types.ToolUseBlock)
    assert tool_use.name == "get_weather" and tool_use.input == json.loads(ARGUMENTS)
    assert message.stop_reason == "tool_use"
    assert not MARKUP.search(json.dumps(message.model_dump()))


def test_responses_items_from_a_harmony_turn() -> None:
    """Responses and Ollama take no scripted ids (`extra_args`), so this reads the harmony
    parser's events into Responses' items directly (Ollama's reply reads `parse()`'s
    reasoning and calls, as chat completions does): a reasoning item, a preamble message, then
    the call, streamed in small pieces."""
    text = CALL_OUTPUT.replace("<|end|><|start|>", "<|end|><|start|>assistant<|channel|>"
                               "commentary<|message|>Checking.<|end|><|start|>", 1)
    parser = ChatStreamParser(None, make_tool_call_parser("openai", TOOLS))
    items = OutputItems()
    for at in range(0, len(text), 7):
        items.feed(parser.feed(text[at:at + 7], is_final=at + 7 >= len(text)))
    items.finish()
    assert [item["type"] for item in items.items] == ["reasoning", "message", "function_call"]
    assert (items.reasoning_text, items.output_text) == (THOUGHT, "Checking.")
    assert (items.items[2]["name"], items.items[2]["arguments"]) == ("get_weather", ARGUMENTS)
    parsed = parser.parse(text)
    assert (parsed.reasoning, parsed.content, [c.name for c in parsed.tool_calls]) \
        == (THOUGHT, "Checking.", ["get_weather"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_give_a_reasoning_item_then_the_call(server: RunningServer,
                                                       stream: bool) -> None:
    """The Responses API through the real server (the default script: the call)."""
    fields: dict[str, Any] = {
        "model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 100,
        "tools": [{"type": "function", **TOOLS[0]["function"]}]}
    if stream:
        with server.client().responses.stream(**fields) as events:
            response = events.get_final_response()
    else:
        response = server.client().responses.create(**fields)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"], kinds
    reasoning, call = response.output
    assert "".join(part.text for part in reasoning.content or []) == THOUGHT
    assert (call.name, call.arguments) == ("get_weather", ARGUMENTS)
    assert not MARKUP.search(response.model_dump_json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ollama_chat_gives_thinking_and_the_call(server: RunningServer, stream: bool) -> None:
    """Ollama's /api/chat through the official client (the default script: the call)."""
    client = ollama.Client(host=server.url)
    fields: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "think": True,
                              "options": {"num_predict": 100}}
    if stream:
        thinking, calls = "", []
        for part in client.chat(stream=True, **fields):
            thinking += part.message.thinking or ""
            calls += part.message.tool_calls or []
    else:
        message = client.chat(**fields).message
        thinking, calls = message.thinking or "", list(message.tool_calls or [])
    assert thinking == THOUGHT
    assert [(c.function.name, c.function.arguments) for c in calls] \
        == [("get_weather", json.loads(ARGUMENTS))]

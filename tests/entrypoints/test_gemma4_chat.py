"""Gemma 4 chat as a user sees it: the real server on a tiny random Gemma 4 (E2B's shape) that
carries Gemma 4's real 262,144-token vocabulary and the chat template inside llama.cpp's
`ggml-vocab-gemma-4.gguf` (tests/model/gemma4_gguf.py), served with `--tool-call-parser gemma4
--reasoning-parser gemma4` and driven by the official `openai` and `anthropic` SDKs.

The `ScriptedOutput` logits processor (scripted_output.py) makes the random model write a given
text, token by token through the real engine: Gemma 4's format tokens (`<|channel>`,
`<|tool_call>`, `<|"|>` ...) as the single ids the real tokenizer gives them, a call's output
ended by `<|tool_response>` and an answer by `<turn|>` (both stop ids of a gemma4 model), as
Gemma 4 ends them. What comes back:

- a thought section as the reasoning field (`reasoning_content` on chat completions, a
  `thinking` block on Messages), never in the content;
- `<|tool_call>call:NAME{...}<tool_call|>` as a call with JSON arguments, strings holding
  quotes, braces, commas and newlines, one call or two, streamed or not, finish reason
  `tool_calls` / stop reason `tool_use`;
- a call and its result going back through the real template for a second turn (folded into
  the model turn as `<|tool_response>response:NAME{...}<tool_response|>`), and thinking off
  ending the prompt in the empty thought section the template writes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from scripted_chat import script_ids, scripted, scripted_server
from server_harness import RunningServer

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.tokenizer import load_tokenizer_from_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from gemma4_gguf import write_tiny_gemma4_real_vocab_gguf
from llama_cpp_files import llama_cpp_file

MODEL = "tiny-gemma4"
Q = '<|"|>'  # Gemma 4's string delimiter, one token
# the format tokens' ids in Gemma 4's vocabulary (tests/model/test_gemma4_tokenizer.py)
FORMAT_IDS = {"<|channel>": 100, "<channel|>": 101, "<|tool_call>": 48, "<tool_call|>": 49,
              Q: 52, "<|tool_response>": 50, "<tool_response|>": 51, "<turn|>": 106,
              "<|turn>": 105, "<|think|>": 98}
STOP_IDS = (FORMAT_IDS["<turn|>"], FORMAT_IDS["<|tool_response>"])  # a gemma4 model's
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
MARKUP = re.compile(r"<\||\|>")  # any of Gemma 4's format tokens, opening or closing

WEATHER_PARAMETERS = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "description": "The city"},
    "days": {"type": "integer"}, "flags": {"type": "array", "items": {"type": "boolean"}},
    "opts": {"type": "object", "properties": {"unit": {"type": "string"}}}}}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city",
                    "input_schema": WEATHER_PARAMETERS}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

THOUGHT = "I should check the weather."
CALL_TEXT = (f"<|tool_call>call:get_weather{{city:{Q}Pa\"ris {{x}}, \nnew{Q},days:3,"
             f"flags:[true,null],opts:{{unit:{Q}C{Q}}}}}<tool_call|>")
CALL_OUTPUT = f"<|channel>thought\n{THOUGHT}<channel|>{CALL_TEXT}<|tool_response>"
ARGUMENTS = {"city": 'Pa"ris {x}, \nnew', "days": 3, "flags": [True, None],
             "opts": {"unit": "C"}}
TWO_CALLS_OUTPUT = (f"<|channel>thought\nTwo cities.<channel|>"
                    f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
                    f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q},days:2}}<tool_call|>"
                    "<|tool_response>")
ANSWER_OUTPUT = "<|channel>thought\nDone.<channel|>It is sunny.<turn|>"
THINKING = {"reasoning_effort": "low"}  # the server's `enable_thinking: True`


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = llama_cpp_file("models/ggml-vocab-gemma-4.gguf")
    return write_tiny_gemma4_real_vocab_gguf(
        tmp_path_factory.mktemp("tiny-gemma4-chat") / "tiny-gemma4.gguf", vocab)


@pytest.fixture(scope="module")
def served(model_path: Path) -> Iterator[tuple[RunningServer, Any]]:
    """The server, and the model's tokenizer."""
    tokenizer = load_tokenizer_from_gguf(GGUFFile(model_path))
    with scripted_server(model_path, "--served-model-name", MODEL, "--tool-call-parser",
                         "gemma4", "--reasoning-parser", "gemma4") as server:
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
    """The chat completion whose output is `output`, whole or (`stream=True`) its chunks."""
    fields = {"model": MODEL, "messages": ASK, "max_tokens": 200, **asked}
    extra_body = {**script(tokenizer, output), **fields.pop("extra_body", {})}
    return server.client().chat.completions.create(extra_body=extra_body, **fields)


def whole(server: RunningServer, tokenizer: Any, output: str,
          **asked: Any) -> tuple[str | None, str | None, list[dict[str, str]], str]:
    """(reasoning, content, calls, finish_reason) of the request, not streamed."""
    response = chat(server, tokenizer, output, **asked)
    # the output is the script, ended by its stop token (which is in no field)
    assert response.usage.completion_tokens \
        == len(script(tokenizer, output)["extra_args"]["scripted_token_ids"])
    assert not MARKUP.search(response.model_dump_json())  # no format token in any field
    (choice,) = response.choices
    message = choice.message
    reasoning = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == reasoning
    calls = []
    for call in message.tool_calls or []:
        assert CALL_ID.fullmatch(call.id) and call.type == "function"
        calls.append({"name": call.function.name, "arguments": call.function.arguments})
    return reasoning, message.content, calls, choice.finish_reason


def streamed(server: RunningServer, tokenizer: Any, output: str,
             **asked: Any) -> tuple[str | None, str | None, list[dict[str, str]], str | None]:
    """The same, streamed and assembled from the deltas ("" as None)."""
    reasoning = content = ""
    calls: list[dict[str, str]] = []
    ids: set[str] = set()
    finish = None
    for chunk in chat(server, tokenizer, output, stream=True, **asked):
        if not chunk.choices:
            continue
        (choice,) = chunk.choices
        extra = choice.delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning_content") or ""
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert CALL_ID.fullmatch(piece.id) and piece.id not in ids
                assert piece.index == len(calls) and piece.function.arguments == ""
                ids.add(piece.id)
                calls.append({"name": piece.function.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning or None, content or None, calls, finish


def rendered(server: RunningServer, messages: list[dict[str, Any]], **asked: Any) -> str:
    """The prompt text the server renders for a chat request (its /render route runs the
    chat completion's own preparation, `reasoning_effort` included)."""
    response = server.post("/v1/chat/completions/render",
                           {"model": MODEL, "messages": messages, **asked})
    assert response.status_code == 200, response.text
    ids = response.json()["token_ids"]
    return str(server.post("/detokenize", {"tokens": ids}).json()["prompt"])


def test_a_thought_and_a_call_come_back_as_reasoning_and_a_tool_call(
        server: RunningServer, tokenizer: Any) -> None:
    prompt = rendered(server, ASK, tools=TOOLS, **THINKING)
    assert prompt.startswith("<bos><|turn>system\n<|think|><|tool>declaration:get_weather"
                             f"{{description:{Q}Weather in a city{Q}")
    assert prompt.endswith("<tool|><turn|>\n<|turn>user\nWhat is the weather in Paris?<turn|>\n"
                           "<|turn>model\n")  # thinking on: no empty thought section

    asked: dict[str, Any] = {"tools": TOOLS, **THINKING}
    reasoning, content, calls, finish = whole(server, tokenizer, CALL_OUTPUT, **asked)
    assert reasoning == THOUGHT
    assert content is None
    assert [call["name"] for call in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == ARGUMENTS
    assert finish == "tool_calls"
    assert streamed(server, tokenizer, CALL_OUTPUT, **asked) \
        == (reasoning, content, calls, finish)


def test_two_calls_in_one_output(server: RunningServer, tokenizer: Any) -> None:
    asked: dict[str, Any] = {"tools": TOOLS, **THINKING}
    reasoning, content, calls, finish = whole(server, tokenizer, TWO_CALLS_OUTPUT, **asked)
    assert (reasoning, content, finish) == ("Two cities.", None, "tool_calls")
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert streamed(server, tokenizer, TWO_CALLS_OUTPUT, **asked) \
        == (reasoning, content, calls, finish)


def test_the_call_and_its_result_go_back_through_gemma4s_template(
        server: RunningServer, tokenizer: Any) -> None:
    asked: dict[str, Any] = {"tools": TOOLS, **THINKING}
    (first,) = chat(server, tokenizer, CALL_OUTPUT, **asked).choices
    (call,) = first.message.tool_calls
    history: list[dict[str, Any]] = [
        *ASK, {"role": "assistant", "content": first.message.content,
               "reasoning_content": first.message.model_extra["reasoning_content"],
               "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 18, "sky": "sunny"})}]

    # the call as Gemma 4 wrote it (keys sorted, as the template sorts them), its result in the
    # same model turn, and the turn left open for the model to go on (a null argument comes out
    # `None`: the template's format_argument has no case for it and Jinja prints None so)
    prompt = rendered(server, history, **asked)
    assert prompt.endswith(
        "<|turn>user\nWhat is the weather in Paris?<turn|>\n<|turn>model\n"
        f"<|tool_call>call:get_weather{{city:{Q}Pa\"ris {{x}}, \nnew{Q},days:3,"
        f"flags:[true,None],opts:{{unit:{Q}C{Q}}}}}<tool_call|>"
        f"<|tool_response>response:get_weather{{sky:{Q}sunny{Q},temperature:18}}"
        "<tool_response|>")
    assert THOUGHT not in prompt  # this template writes no earlier reasoning back

    answer = whole(server, tokenizer, ANSWER_OUTPUT, **{**asked, "messages": history})
    assert answer == ("Done.", "It is sunny.", [], "stop")
    assert streamed(server, tokenizer, ANSWER_OUTPUT,
                    **{**asked, "messages": history}) == answer


def test_thinking_off_closes_the_thought_section_in_the_prompt(
        server: RunningServer, tokenizer: Any) -> None:
    off: dict[str, Any] = {"reasoning_effort": "none"}
    prompt = rendered(server, ASK, **off)
    assert prompt == ("<bos><|turn>user\nWhat is the weather in Paris?<turn|>\n"
                      "<|turn>model\n<|channel>thought\n<channel|>")
    assert rendered(server, ASK, chat_template_kwargs={"enable_thinking": False}) == prompt
    output = "It is sunny.<turn|>"
    assert whole(server, tokenizer, output, **off) == (None, "It is sunny.", [], "stop")
    assert streamed(server, tokenizer, output, **off) == (None, "It is sunny.", [], "stop")


def anthropic_call(client: anthropic.Anthropic, tokenizer: Any, stream: bool) -> Any:
    """The Messages answer whose output is the scripted call, whole or streamed."""
    fields: dict[str, Any] = {
        "model": MODEL, "max_tokens": 200, "messages": ASK, "tools": ANTHROPIC_TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": script(tokenizer, CALL_OUTPUT)}
    if not stream:
        return client.messages.create(**fields)
    with client.messages.stream(**fields) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages_give_a_thinking_block_and_a_tool_use(
        server: RunningServer, tokenizer: Any, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = anthropic_call(client, tokenizer, stream)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    thinking, tool_use = message.content
    assert thinking.thinking == THOUGHT
    assert tool_use.name == "get_weather" and tool_use.input == ARGUMENTS
    assert message.stop_reason == "tool_use"
    assert not MARKUP.search(json.dumps(message.model_dump()))

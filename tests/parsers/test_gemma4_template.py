"""Gemma 4's real chat templates (llama.cpp's `models/templates/google-gemma-4-31B-it.jinja` and
the older `-interleaved` one) through nanoserve's prompt building (`serving/chat_prompt.py`,
`serving/gemma4_template.py`): a thinking turn with a tool call and its result, the model turn
llama.cpp PR #21760 opens, reasoning effort as `enable_thinking`, the tool format the template
implies, and the `gemma4` parsers reading back what the template writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from nanoserve.entrypoints.serving.chat_input import (
    ChatInput,
    MessageInput,
    TemplateOptions,
    ToolCallInput,
    ToolFunction,
    ToolInput,
)
from nanoserve.entrypoints.serving.chat_prompt import render_prompt
from nanoserve.entrypoints.serving.reasoning_options import reasoning_start, with_reasoning_effort
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.reasoning import make_reasoning_parser, prompt_ends_in_reasoning
from nanoserve.parsers.tool_calls import make_tool_call_parser
from nanoserve.parsers.tool_format import template_tool_format
from nanoserve.reasoning_section import OPENING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from llama_cpp_files import llama_cpp_file

NEWER = "models/templates/google-gemma-4-31B-it.jinja"
OLDER = "models/templates/google-gemma-4-31B-it-interleaved.jinja"
Q = '<|"|>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "A city"}},
                   "required": ["city"]}}}
SYSTEM_TURN = (
    f"<|turn>system\n<|tool>declaration:get_weather{{description:{Q}The weather{Q},parameters:"
    f"{{properties:{{city:{{description:{Q}A city{Q},type:{Q}STRING{Q}}}}},required:[{Q}city{Q}],"
    f"type:{Q}OBJECT{Q}}}}}<tool|><turn|>\n")
ASK = MessageInput("user", "Weather in Paris?")


def template(path: str) -> str:
    return llama_cpp_file(path).read_text()


def context(chat_template: str, reasoning_parser: str | None = "gemma4") -> ServerContext:
    """What render_prompt and with_reasoning_effort read of a server: a tokenizer whose `<bos>`
    is Gemma's, the template as `--chat-template`."""
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    return cast(ServerContext, SimpleNamespace(
        has_chat_template=True, accepts_images=False, template_reads_tools=True,
        chat_template=chat_template, tokenizer=tokenizer, reasoning_parser=reasoning_parser,
        has_reasoning_tokens=False))


def weather_call(content: str | None = None, reasoning: str | None = None) -> MessageInput:
    return MessageInput("assistant", content, reasoning=reasoning, tool_calls=(
        ToolCallInput("c0", "get_weather", json.dumps({"city": "Paris"})),))


def chat(*messages: MessageInput, **template_kwargs: Any) -> ChatInput:
    return ChatInput(messages=(ASK, *messages),
                     tools=(ToolInput(ToolFunction("get_weather"), WEATHER),),
                     template=TemplateOptions(kwargs=template_kwargs or None))


def test_a_thinking_turn_with_a_call_and_its_result_in_the_newer_template() -> None:
    """The 31B template finds the tool message by its call id and writes the earlier turn's
    reasoning (it came after the last user turn); the model goes on in its own turn."""
    prompt = render_prompt(context(template(NEWER)), chat(
        weather_call(reasoning="The user wants Paris."),
        MessageInput("tool", '{"temp": 21, "sky": "sunny"}', tool_call_id="c0"),
        enable_thinking=True))
    assert prompt == (
        "<bos>" + SYSTEM_TURN.replace("system\n", "system\n<|think|>\n")
        + "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
        "<|channel>thought\nThe user wants Paris.\n<channel|>"
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
        f'<|tool_response>response:get_weather{{value:{Q}{{"temp": 21, "sky": "sunny"}}{Q}}}'
        "<tool_response|>")
    assert not prompt_ends_in_reasoning(prompt, "gemma4")


def test_the_older_template_gets_the_results_as_tool_responses() -> None:
    """The older template reads only `tool_responses`: the tool message and the answer after it
    are folded into the assistant's message (llama.cpp's convert_tool_responses_gemma4), JSON
    results written as Gemma's key:value pairs; the reasoning between calls stays."""
    older = template(OLDER)
    assert "tool_call_id" not in older and "tool_responses" in older
    prompt = render_prompt(context(older), chat(
        weather_call(reasoning="Paris."),
        MessageInput("tool", '{"temp": 21, "sky": "sunny"}', tool_call_id="c0"),
        MessageInput("assistant", "It is sunny."), MessageInput("user", "Thanks")))
    assert prompt == (
        "<bos>" + SYSTEM_TURN + "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
        f"<|tool_response>response:get_weather{{sky:{Q}sunny{Q},temp:21}}<tool_response|>"
        "It is sunny.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
        "<|channel>thought\n<channel|>")
    after_result = render_prompt(context(older), chat(
        weather_call(reasoning="Paris."), MessageInput("tool", "sunny", tool_call_id="c0")))
    assert after_result.endswith(
        f"<|turn>model\n<|channel>thought\nParis.<channel|><|tool_call>call:get_weather{{city:"
        f"{Q}Paris{Q}}}<tool_call|><|tool_response>response:get_weather{{value:{Q}sunny{Q}}}"
        "<tool_response|><|channel>thought\n<channel|>")


@pytest.mark.parametrize("path", [NEWER, OLDER])
def test_a_model_turn_after_results_closed_by_content(path: str) -> None:
    """llama.cpp's PR #21760 vectors (`tests/test-chat.cpp`, "additional tests for
    https://github.com/ggml-org/llama.cpp/pull/21760"): content beside a call closes the model
    turn after the result; the generation prompt opens a new one, and only when asked for."""
    messages = (weather_call(content="Let me check."),
                MessageInput("tool", '{"r":"ok"}', tool_call_id="c0"))
    prompt = render_prompt(context(template(path)), chat(*messages))
    if path == NEWER:  # (the older one drops the call's own text, as llama.cpp does)
        assert prompt.endswith("<turn|>\n<|turn>model\n")
    closed = ChatInput(messages=(ASK, *messages), tools=chat().tools,
                       template=TemplateOptions(add_generation_prompt=False))
    assert not render_prompt(context(template(path)), closed).endswith("<|turn>model\n")


@pytest.mark.parametrize(("effort", "thinks"), [("none", False), ("low", True), ("high", True),
                                                (None, False)])
def test_reasoning_effort_turns_thinking_on_or_off(effort: str | None, thinks: bool) -> None:
    """Gemma 4 thinks or not (`enable_thinking` puts `<|think|>` in the system turn); any effort
    but none turns it on, none off; without an effort the template's default (off) holds."""
    ctx = context(template(NEWER))
    request = with_reasoning_effort(ctx, ChatInput(messages=(ASK,), reasoning_effort=effort))
    prompt = render_prompt(ctx, request)
    assert ("<|think|>" in prompt) is thinks
    assert prompt.endswith("<|turn>model\n" if thinks else "<|turn>model\n<|channel>thought\n"
                           "<channel|>")
    assert reasoning_start(request, prompt, "gemma4") == OPENING
    answer = "<|channel>thought\nHm.<channel|>Yes." if thinks else "Yes."
    parsed = ChatStreamParser(make_reasoning_parser("gemma4", False), None).parse(answer)
    assert (parsed.reasoning, parsed.content) == ("Hm." if thinks else None, "Yes.")


@pytest.mark.parametrize("path", [NEWER, OLDER])
def test_the_template_implies_the_gemma4_tool_parser(path: str) -> None:
    found = template_tool_format(template(path))
    assert (found.parser, found.reads_tools) == ("gemma4", True)


def test_the_parser_reads_back_the_calls_the_template_writes() -> None:
    """An earlier call with awkward arguments, written by the 31B template, parses back to the
    same arguments (the template sorts the keys)."""
    arguments = {"path": 'a "b".txt', "text": 'x = {"k": [1, 2]},\ny \\ z', "n": 3,
                 "flags": [True, False, None], "opts": {"deep": {"x": 1.5, "s": "]}"}}}
    call = MessageInput("assistant", None, tool_calls=(
        ToolCallInput("c0", "write_file", json.dumps(arguments)),))
    prompt = render_prompt(context(template(NEWER)), ChatInput(messages=(ASK, call)))
    written = prompt[prompt.index("<|tool_call>"):prompt.index("<tool_call|>") + 12]
    content, (parsed,) = make_tool_call_parser("gemma4").parse(written)
    assert content is None and parsed.name == "write_file"
    assert json.loads(parsed.arguments) == arguments

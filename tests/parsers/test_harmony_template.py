"""gpt-oss's harmony template (llama.cpp's `models/templates/openai-gpt-oss-120b.jinja`) through
nanoserve's prompt building (`serving/chat_prompt.py`, `serving/harmony_template.py`,
`serving/reasoning_options.py`), against `openai-harmony`'s renderer; and the grammar that
constrains only the final message (`serving/harmony_grammar.py`) on the real o200k tokenizer."""

from __future__ import annotations

import datetime
import json
import os
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
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.harmony_grammar import harmony_grammar
from nanoserve.entrypoints.serving.reasoning_options import with_reasoning_effort
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.tool_plan import plan_tools
from nanoserve.sampling_params import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from llama_cpp_files import llama_cpp_file

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string",
                                                       "description": "The city"}},
              "required": ["city"]}
ASK = MessageInput("user", "Weather in Paris?")


def tool() -> ToolInput:
    function = ToolFunction("get_weather", "Weather in a city", PARAMETERS)
    return ToolInput(function, {"type": "function", "function": {
        "name": function.name, "description": function.description, "parameters": PARAMETERS}})


def context() -> ServerContext:
    vocab = {"<unk>": 0}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>")
    template = llama_cpp_file("models/templates/openai-gpt-oss-120b.jinja").read_text()
    return cast(ServerContext, SimpleNamespace(
        has_chat_template=True, accepts_images=False, template_reads_tools=True,
        chat_template=template, tokenizer=tokenizer, reasoning_parser="openai_gptoss",
        tool_call_parser="openai", has_reasoning_tokens=False, is_harmony=True))


def render(messages: list[MessageInput], effort: str | None = None,
           tools: list[ToolInput] | None = None, **template: Any) -> str:
    ctx = context()
    chat = ChatInput(messages=tuple(messages), reasoning_effort=effort,
                     tools=tuple(tools) if tools else None,
                     template=TemplateOptions(**template) if template else TemplateOptions())
    return render_prompt(ctx, with_reasoning_effort(ctx, chat))


@pytest.fixture(scope="module")
def harmony() -> Any:
    from nanoserve.bench.o200k_harmony import harmony_encoding_dir

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(harmony_encoding_dir())
    module = pytest.importorskip("openai_harmony")
    module.encoding = module.load_harmony_encoding(module.HarmonyEncodingName.HARMONY_GPT_OSS)
    return module


def oracle(h: Any, effort: str, instructions: str | None, with_tools: bool,
           history: list[Any]) -> str:
    """openai-harmony's prompt for the same conversation, dated today as the template is."""
    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(effort.title())) \
        .with_conversation_start_date(datetime.date.today().isoformat())
    messages = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    if instructions or with_tools:
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if with_tools:
            developer = developer.with_function_tools([h.ToolDescription.new(
                "get_weather", "Weather in a city", parameters=PARAMETERS)])
        messages.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    messages += [h.Message.from_role_and_content(h.Role.USER, ASK.content), *history]
    conversation = h.Conversation.from_messages(messages)
    tokens = h.encoding.render_conversation_for_completion(conversation, h.Role.ASSISTANT)
    return cast(str, h.encoding.decode(tokens))


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
@pytest.mark.parametrize(("instructions", "with_tools"), [(None, False), ("Be brief.", False),
                                                          ("Be brief.", True), (None, True)])
def test_the_prompt_is_openai_harmonys(harmony: Any, effort: str, instructions: str | None,
                                       with_tools: bool) -> None:
    messages = ([MessageInput("system", instructions)] if instructions else []) + [ASK]
    got = render(messages, effort, [tool()] if with_tools else None)
    assert f"Reasoning: {effort}\n" in got
    if instructions and not with_tools:  # the template's one difference: instructions
        got = got.replace("Be brief.\n\n<|end|>", "Be brief.<|end|>")  # end in "\n\n"
    assert got == oracle(harmony, effort, instructions, with_tools, [])


def test_a_call_and_its_result_render_as_openai_harmony_writes_them(harmony: Any) -> None:
    """The call keeps its analysis (no final answer after it yet); the result is written under
    the call's name. Differences from openai-harmony, by the template's design: the call's
    header says `commentary json` where harmony writes `commentary <|constrain|>json`, and
    the result's body is the content as a JSON string (`|tojson`)."""
    h = harmony
    call = ToolCallInput("call_1", "get_weather", '{"city": "Paris"}')
    got = render([ASK, MessageInput("assistant", None, tool_calls=(call,), reasoning="Look up."),
                  MessageInput("tool", '{"temp": 21}', tool_call_id="call_1")], "medium", [tool()])
    history = [
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Look up.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary").with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"),
                                          json.dumps('{"temp": 21}'))
        .with_channel("commentary").with_recipient("assistant")]
    want = oracle(h, "medium", None, True, history)
    assert got == want.replace("commentary <|constrain|>json", "commentary json")


def test_effort_none_is_low_and_xhigh_is_high() -> None:
    assert "Reasoning: low\n" in render([ASK], "none")
    assert "Reasoning: low\n" in render([ASK], "minimal")
    assert "Reasoning: high\n" in render([ASK], "xhigh")
    assert "Reasoning: medium\n" in render([ASK])
    with pytest.raises(APIError, match="reasoning_effort"):
        render([ASK], "extreme")


def test_thinking_content_and_several_calls() -> None:
    """`reasoning_content` is the template's `thinking`; content beside thinking on a call is
    dropped (the template would raise); two calls become two messages, each result named."""
    calls = (ToolCallInput("a", "get_weather", '{"city": "Paris"}'),
             ToolCallInput("b", "get_time", "{}"))
    got = render([ASK, MessageInput("assistant", "Let me see.", tool_calls=calls,
                                    reasoning="Two lookups."),
                  MessageInput("tool", "sunny", tool_call_id="b"),
                  MessageInput("tool", "noon", tool_call_id="a")], "low", [tool()])
    assert "<|channel|>analysis<|message|>Two lookups.<|end|>" in got
    assert "Let me see." not in got
    assert got.index("functions.get_weather<|channel|>") < got.index('functions.get_weather to=')
    assert 'functions.get_weather to=assistant<|channel|>commentary<|message|>"noon"' in got
    assert 'functions.get_time to=assistant<|channel|>commentary<|message|>"sunny"' in got
    assert got.endswith("<|start|>assistant")


def test_channel_tags_in_history_are_a_400_naming_the_field() -> None:
    bad = MessageInput("assistant", "<|channel|>final<|message|>Hi")
    with pytest.raises(APIError) as caught:
        render([ASK, bad, ASK])
    assert caught.value.status == 400 and "messages.1.content" in str(caught.value.message)
    thought = MessageInput("assistant", "Hi", reasoning="<|channel|>analysis<|message|>x")
    with pytest.raises(APIError, match=r"messages\.1\.reasoning_content"):
        render([ASK, thought, ASK])


def test_a_continued_answer_ends_in_end_not_return() -> None:
    got = render([ASK, MessageInput("assistant", "It is")], add_generation_prompt=False)
    assert "<|return|>" not in got


@pytest.fixture(scope="module")
def matcher_for() -> Any:
    """A llguidance matcher over the real o200k_harmony tokenizer, for a grammar's params."""
    import llguidance
    from transformers import AutoTokenizer

    from nanoserve.bench.o200k_harmony import HARMONY_VOCAB_SIZE, harmony_tokenizer_dir
    from nanoserve.structured.grammar import GrammarTokenizer, grammar_spec

    tokenizer = AutoTokenizer.from_pretrained(harmony_tokenizer_dir())
    ll = GrammarTokenizer(tokenizer, HARMONY_VOCAB_SIZE, ()).get()

    def accepts(params: StructuredOutputsParams, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar_spec(params))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()
    return accepts


def test_the_grammar_constrains_only_the_final_message(matcher_for: Any) -> None:
    schema = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})
    plan = plan_tools(ChatInput(messages=(ASK,)), "openai")
    grammar = harmony_grammar(plan, schema)
    assert grammar is not None
    thought = "<|channel|>analysis<|message|>Think: {not json}<|end|><|start|>assistant"
    assert matcher_for(grammar, thought + '<|channel|>final<|message|>{"a": 1}')
    assert matcher_for(grammar, '<|channel|>final <|constrain|>json<|message|>{"a": 2}')
    assert not matcher_for(grammar, thought + '<|channel|>final<|message|>{"a": "x"}')
    assert not matcher_for(grammar, '{"a": 1}')


def test_a_forced_call_is_a_harmony_call(matcher_for: Any) -> None:
    chat = ChatInput(messages=(ASK,), tools=(tool(),),
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    grammar = harmony_grammar(plan_tools(chat, "openai"), None)
    assert grammar is not None
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    assert matcher_for(grammar, call + '{"city": "Paris"}')
    assert not matcher_for(grammar, call + '{"town": "Paris"}')
    assert not matcher_for(grammar, '<|channel|>final<|message|>{"city": "Paris"}')

"""Harmony (gpt-oss) output parsing (nanoserve/parsers/harmony.py): llama.cpp's gpt-oss parse
vectors (tests/test-chat.cpp, "GPT-OSS format tests") and the cases its rules name, whole and
streamed at every split, and `openai-harmony`'s own parser as the oracle over seeded outputs
that its encoder writes."""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from nanoserve.parsers.harmony import FORMAT_TOKENS, HarmonyParser
from nanoserve.parsers.reasoning import make_reasoning_parser
from nanoserve.parsers.tool_calls import make_tool_call_parser
from nanoserve.parsers.tool_format import template_tool_format

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from llama_cpp_files import llama_cpp_file

Parsed = tuple[str | None, str | None, list[tuple[str, str]]]  # reasoning, content, calls
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("special_function", "edit",
                                                                 "get_weather", "shell")]
THOUGHT, ANSWER = "I'm\nthinking", "Hello, world!\nWhat's up?"
CALL = [("special_function", '{"arg1": 1}')]
EDIT = ('{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
        '"replaceAll": false}')
# llama.cpp's vectors: (output, reasoning, content, calls); its expected empty content is None
LLAMA_CPP = [
    ("<|channel|>final<|message|>" + ANSWER, None, ANSWER, []),
    ("<|channel|>commentary<|message|>" + ANSWER, None, ANSWER, []),
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final"
     "<|message|>" + ANSWER, THOUGHT, ANSWER, []),
    ("<|channel|>analysis<|message|>I'm\nthinking", THOUGHT, None, []),
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', None, None, CALL),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', None, None, CALL),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
     None, None, CALL),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', None, None,
     CALL),
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions."
     'special_function<|channel|>analysis<|message|>{"arg1": 1}', THOUGHT, None, CALL),
    ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.edit <|constrain|>json<|message|>" + EDIT,
     "Thinking about edit...", None, [("edit", EDIT)]),
    ("<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
     "<|start|>assistant<|channel|>final <|constrain|>json<|message|>"
     '{"amount": 123.45, "date": "2025-12-03"}', "I need to output the invoice details in JSON",
     '{"amount": 123.45, "date": "2025-12-03"}', []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
     " to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
     "I will execute python to say hello", None, []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
     "<|channel|>commentary to=python <|constrain|>code<|message|>print(\"hello\")",
     "I will execute python to say hello", None, []),
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|>"
     "<|start|>assistant<|channel|>final<|message|>" + ANSWER, THOUGHT, ANSWER, []),
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>commentary"
     " to=assistant<|channel|>final<|message|>" + ANSWER, THOUGHT, ANSWER, []),
]
# the rules llama.cpp's vectors leave out (harmony.py's docstring)
CASES = [
    # a preamble, then a call ended by <|call|>; a final ended by <|return|>
    ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
     ' <|constrain|>json<|message|>{"city":"Paris"}<|call|>', "Plan.", "Checking.",
     [("get_weather", '{"city":"Paris"}')]),
    ("<|channel|>final<|message|>Done.<|return|>", None, "Done.", []),
    # a glued json (llama.cpp PR #15158), an empty body, an unknown function is still a call
    ('<|channel|>commentary to=functions.shelljson<|message|>{"cmd":["ls"]}', None, None,
     [("shell", '{"cmd":["ls"]}')]),
    ("<|channel|>commentary to=functions.get_weather<|message|><|call|>", None, None,
     [("get_weather", "{}")]),
    ("<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}", None, None,
     [("nope", "{}")]),
    # reasoning after a call; a browser call swallowed; text in a body is never a header
    ('<|channel|>commentary to=functions.edit<|message|>{}<|end|><|start|>assistant<|channel|>'
     "analysis<|message|>Then <|chan and to=functions.x<|end|><|start|>assistant to=browser.search"
     '<|channel|>analysis<|message|>{"q": 1}<|end|><|start|>assistant<|channel|>final<|message|>'
     "A < B", "Then <|chan and to=functions.x", "A < B", [("edit", "{}")]),
    # plain text without a header is content; a header cut off gives nothing
    ("Just text <|end", None, "Just text <|end", []),
    ("<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|channel|>fin", "Hm", None, []),
]


def parser(tools: list[dict[str, Any]] | None = TOOLS) -> ChatStreamParser:
    return ChatStreamParser(None, make_tool_call_parser("openai", tools))


def summary(events: list[ChatEvent]) -> Parsed:
    """What the events add up to, checking each call runs start, arguments, end."""
    calls: list[tuple[str, str]] = []
    open_call: int | None = None
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None and event.index == len(calls)
            calls.append((event.name, ""))
            open_call = event.index
        elif isinstance(event, ToolCallArguments):
            assert event.index == open_call
            calls[-1] = (calls[-1][0], calls[-1][1] + event.delta)
        elif isinstance(event, ToolCallEnd):
            assert event.index == open_call
            open_call = None
        else:
            assert open_call is None, "text inside a call"
    assert open_call is None
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    return reasoning or None, content or None, calls


def whole(text: str, tools: list[dict[str, Any]] | None = TOOLS) -> Parsed:
    parsed = parser(tools).parse(text)
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def streamed(text: str, points: list[int], tools: list[dict[str, Any]] | None = TOOLS) -> Parsed:
    chat, events = parser(tools), []
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        events += chat.feed(text[a:b], is_final=b == len(text))
    return summary(events)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), LLAMA_CPP + CASES)
def test_whole_and_streamed_at_every_split(text: str, reasoning: str | None,
                                           content: str | None,
                                           calls: list[tuple[str, str]]) -> None:
    assert whole(text) == (reasoning, content, calls)
    assert streamed(text, list(range(1, len(text)))) == (reasoning, content, calls)
    for cut in range(len(text) + 1):
        assert streamed(text, [cut]) == (reasoning, content, calls), cut


def test_the_vectors_are_llama_cpps() -> None:
    """Each of LLAMA_CPP's outputs is in test-chat.cpp's gpt-oss block (as C++ writes it)."""
    source = llama_cpp_file("tests/test-chat.cpp").read_text()
    block = source[source.index("// GPT-OSS format tests"):]
    literal = r'"(?:[^"\\\n]|\\.)*"'  # adjacent C++ string literals are one string
    strings = ["".join(s[1:-1] for s in re.findall(literal, run))
               for run in re.findall(rf"(?:{literal}\s*)+", block)]
    for text, *_ in LLAMA_CPP:
        cpp = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        assert any(s.startswith(cpp[:60]) for s in strings), cpp[:60]


def test_only_a_partial_format_token_is_held() -> None:
    """Fed one character at a time, reasoning, content and arguments trail the whole parse of
    the text so far by at most a partial format token (headers are not text)."""
    text = CASES[0][0] + "<|start|>assistant<|channel|>final<|message|>Fine <|en"
    chat, events = parser(), []
    for i, ch in enumerate(text):
        events += chat.feed(ch)
        reasoning, content, calls = whole(text[:i + 1])
        arguments = "".join(e.delta for e in events if isinstance(e, ToolCallArguments))
        for sent, full in (
                ("".join(e.text for e in events if isinstance(e, ReasoningDelta)), reasoning),
                ("".join(e.text for e in events if isinstance(e, TextDelta)), content),
                (arguments, "".join(a for _, a in calls))):
            if full == "{}" and not sent:  # a body cut off empty is closed as `{}`
                continue
            held = (full or "")[len(sent):]
            assert (full or "").startswith(sent)
            assert not held or any(t.startswith(held) and t != held for t in FORMAT_TOKENS)


def test_without_tools_calls_are_swallowed_and_reasoning_can_be_dropped() -> None:
    text = CASES[0][0]
    assert whole(text, tools=None)[2] == [("get_weather", '{"city":"Paris"}')]
    quiet = ChatStreamParser(None, HarmonyParser(include_reasoning=False, parses_calls=False))
    parsed = quiet.parse(text)
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == (None, "Checking.", [])
    alone = make_reasoning_parser("openai_gptoss", False)  # the reasoning parser by itself
    assert alone.parse(text) == ("Plan.", "Checking.")
    r, c = alone.feed(text[:50])
    r2, c2 = alone.feed(text[50:])
    r3, c3 = alone.finish()
    assert (r + r2 + r3, c + c2 + c3) == ("Plan.", "Checking.")


def test_the_harmony_template_chooses_the_parsers() -> None:
    template = llama_cpp_file("models/templates/openai-gpt-oss-120b.jinja").read_text()
    found = template_tool_format(template)
    assert (found.parser, found.reads_tools) == ("openai", True)
    gemma = llama_cpp_file("models/templates/google-gemma-4-31B-it.jinja").read_text()
    assert template_tool_format(gemma).parser == "gemma4"


# --- openai-harmony as the oracle ---------------------------------------------------------

@pytest.fixture(scope="module")
def encoding() -> Any:
    """openai-harmony's HARMONY_GPT_OSS, loaded offline from the o200k ranks built locally."""
    from nanoserve.bench.o200k_harmony import harmony_encoding_dir

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(harmony_encoding_dir())
    harmony = pytest.importorskip("openai_harmony")
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


WORDS = ["Paris", " the", " weather", "\n", " {", "}", ' "q"', " <", "|", " to=", "json", " é",
         " 42", ",", ":", " ok"]


def random_messages(rng: random.Random) -> list[Any]:
    """Assistant messages as gpt-oss writes a turn: analysis and preambles, then a final
    answer or a call (recipient in the role part, content type `<|constrain|>json`)."""
    from openai_harmony import Message, Role

    def text() -> str:
        return "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))

    messages = []
    for _ in range(rng.randint(0, 3)):
        channel = rng.choice(["analysis", "analysis", "commentary"])
        messages.append(Message.from_role_and_content(Role.ASSISTANT, text())
                        .with_channel(channel))
    if rng.random() < 0.5:
        arguments = json.dumps({"city": text(), "days": rng.randint(0, 9)},
                               separators=rng.choice([(",", ":"), (", ", ": ")]))
        messages.append(Message.from_role_and_content(Role.ASSISTANT, arguments)
                        .with_channel(rng.choice(["commentary", "analysis"]))
                        .with_recipient(rng.choice(["functions.get_weather", "browser.search"]))
                        .with_content_type("<|constrain|>json"))
    else:
        messages.append(Message.from_role_and_content(Role.ASSISTANT, text())
                        .with_channel("final"))
    return messages


@pytest.mark.parametrize("seed", range(40))
def test_openai_harmony_parses_what_nanoserve_parses(encoding: Any, seed: int) -> None:
    """A seeded turn written by openai-harmony's encoder (stop token kept or not, as a
    detokenizer may drop it), read by `parse_messages_from_completion_tokens` and by nanoserve:
    the same reasoning, content and calls, whole and streamed."""
    from openai_harmony import Role

    rng = random.Random(seed)
    tokens = [t for m in random_messages(rng) for t in encoding.render(m)][2:]  # after the
    oracle = encoding.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)  # prompt's
    reasoning, content, calls = "", "", []  # `<|start|>assistant`
    for message in oracle:
        body = "".join(part.text for part in message.content)
        if message.recipient and message.recipient.startswith("functions."):
            calls.append((message.recipient.removeprefix("functions."), body))
        elif message.recipient:
            continue
        elif message.channel == "analysis":
            reasoning += body
        else:
            content += body
    text = encoding.decode(tokens)
    if rng.random() < 0.5:  # the stop token (<|call|> or <|return|>) left out of the text
        text = text[:text.rindex("<|")]
    expected = (reasoning or None, content or None, calls)
    assert whole(text) == expected
    assert streamed(text, sorted(rng.sample(range(1, len(text)), 5))) == expected

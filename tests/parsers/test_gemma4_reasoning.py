"""The `gemma4` reasoning parser (nanoserve/parsers/reasoning.py): llama.cpp's Gemma 4 parse
vectors, streamed in every chunking equal to the whole parse, what is held back, and where a
Gemma 4 prompt leaves the output (inside a thought section or not)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.events import ChatEvent, ReasoningDelta, TextDelta
from nanoserve.parsers.reasoning import (
    Gemma4ReasoningParser,
    make_reasoning_parser,
    prompt_ends_in_reasoning,
)

ANSWER = "Hello, world!\nWhat's up?"

# llama.cpp's Gemma 4 parse vectors without tools (sdist llama.cpp `tests/test-chat.cpp`, the
# "Google Gemma 4" block, l.2992-3072, `reasoning_format(AUTO)`): (output, reasoning, content).
LLAMA_CPP_VECTORS = [
    # `tst.test("Hello, world!")`
    ("Hello, world!", None, "Hello, world!"),
    # "Reasoning and content" (message_assist_thoughts)
    ("<|channel>thought\nI'm\nthinking<channel|>" + ANSWER, "I'm\nthinking", ANSWER),
    # "Empty reasoning (budget=0: sampler forces end tag before newline)"
    ("<|channel>thought<channel|>" + ANSWER, None, ANSWER),
    # "Edge cases" (PR #21760): an empty section after the answer, a stray <channel|>, and an
    # extra empty <|channel> before the section; all expect message_assist
    ("<|channel>thought\n<channel|>" + ANSWER + "<channel|>", None, ANSWER),
    ("<|channel>thought\n<channel|>" + ANSWER + "<|channel>thought\n<channel|>", None, ANSWER),
    ("<|channel>thought\n<channel|>" + ANSWER + "<|channel>thought\n<channel|><channel|>", None,
     ANSWER),
    ("<|channel><|channel>thought\n<channel|>" + ANSWER, None, ANSWER),
]

# The continuation vectors (l.3131-3150): llama.cpp parses the prefill and the output together;
# nanoserve's parser sees the output only, the prompt telling where it starts (`prompt`: the
# generation prompts llama.cpp's test_template_generation_prompt expects, l.7023-7032).
# (prompt's end, output, reasoning, content)
CONTINUATIONS = [
    ("<|turn>model\n<|channel>thought\nI'm thinking<channel|>Hello, ", "world!\nWhat's up?",
     None, "world!\nWhat's up?"),
    ("<|turn>model\n<|channel>thought\nI'm", " thinking<channel|>" + ANSWER, " thinking",
     ANSWER),
]

EXAMPLES = [
    # (output, reasoning, content)
    ("", None, None),
    ("<|channel>thought\nplan<channel|>", "plan", None),
    ("<|channel>thought\nstill thinking", "still thinking", None),  # cut off: all reasoning
    ("<|channel>thought\n\nplan\n<channel|>\nanswer", "\nplan\n", "\nanswer"),  # one "\n" only
    ("<|channel>thoughts<channel|>x", "s", "x"),  # the label, then text
    ("<|channel>plan<channel|>x", "plan", "x"),  # no label
    ("<|channel>thought", None, None),  # the label alone, cut off
    ("<|channel>thou", "thou", None),  # a partial label is text of the section
    ("<|channel>thought\na<channel|>b<|channel>thought\nc<channel|>d", "ac", "bd"),
    ("<|turn>model\n<|channel>thought\nplan<channel|>answer", "plan", "answer"),
    ("answer <|turn>model\n", None, "answer <|turn>model\n"),  # only at the very start
    ("<|turn>mod", None, "<|turn>mod"),
    ("a < b <| c <chan", None, "a < b <| c <chan"),
    ("2 <channel|> 3", None, "2  3"),  # a stray end tag is dropped
    ("<|channel>thought\nx <|chan<channel|>y", "x <|chan", "y"),
    ("<think>a</think>b", None, "<think>a</think>b"),  # Qwen's tags are text here
    ("<|channel>thought\n世界🦜<channel|>🦜", "世界🦜", "🦜"),
]

PIECES = ["<|channel>", "<channel|>", "thought", "thought\n", "\n", " ", "hi", "世", "🦜", "<",
          "<|", "<|chan", "nel>", "<chan", "nel|>", "|>", "<|turn>model\n", "<|turn>", "model",
          "thou", "ght"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(alphabet="<|>chanel thougt\n",
                                                           max_size=4)),
                 max_size=14).map("".join)


def stream(parser: Gemma4ReasoningParser,
           deltas: list[str]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """Feeds the deltas and finishes; the totals (None where empty) and the fields sent before
    finish() after each delta."""
    reasoning = content = ""
    sent: list[tuple[str, str]] = []
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning, content = reasoning + r, content + c
        sent.append((reasoning, content))
    r, c = parser.finish()
    return reasoning + r or None, content + c or None, sent


def parser(inside: bool = False) -> Gemma4ReasoningParser:
    made = make_reasoning_parser("gemma4", inside)
    assert isinstance(made, Gemma4ReasoningParser)
    return made


def every_chunking(text: str, inside: bool, expected: tuple[str | None, str | None]) -> None:
    """The whole parse, and the stream in two pieces at every point, one character at a time
    and in random pieces, all give `expected`."""
    assert parser(inside).parse(text) == expected
    assert stream(parser(inside), list(text))[:2] == expected
    for at in range(len(text) + 1):
        assert stream(parser(inside), [text[:at], text[at:]])[:2] == expected, at
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(parser(inside), pieces)[:2] == expected


@pytest.mark.parametrize(("text", "reasoning", "content"), LLAMA_CPP_VECTORS)
def test_llama_cpp_vectors_whole_and_streamed(text: str, reasoning: str | None,
                                              content: str | None) -> None:
    every_chunking(text, False, (reasoning, content))


@pytest.mark.parametrize(("prompt", "output", "reasoning", "content"), CONTINUATIONS)
def test_llama_cpp_continuations(prompt: str, output: str, reasoning: str | None,
                                 content: str | None) -> None:
    inside = prompt_ends_in_reasoning(prompt, "gemma4")
    every_chunking(output, inside, (reasoning, content))


@pytest.mark.parametrize(("text", "reasoning", "content"), EXAMPLES)
def test_worked_examples(text: str, reasoning: str | None, content: str | None) -> None:
    every_chunking(text, False, (reasoning, content))


@pytest.mark.parametrize(("text", "expected"), [
    ("plan<channel|>answer", ("plan", "answer")),
    ("thought\nplan<channel|>answer", ("thought\nplan", "answer")),  # the label was the prompt's
    ("unfinished", ("unfinished", None)),
    ("<|turn>model\nx", ("<|turn>model\nx", None)),
])
def test_starting_inside_a_section(text: str, expected: tuple[str | None, str | None]) -> None:
    every_chunking(text, True, expected)


@pytest.mark.parametrize("inside", [False, True])
@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_streamed_equals_parse_and_nothing_is_taken_back(inside: bool, text: str,
                                                         cuts: list[int]) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    reasoning, content, sent = stream(parser(inside), deltas)
    assert (reasoning, content) == parser(inside).parse(text)
    for so_far_reasoning, so_far_content in sent:
        assert (reasoning or "").startswith(so_far_reasoning)
        assert (content or "").startswith(so_far_content)
    assert len(reasoning or "") + len(content or "") <= len(text)
    # the tags never reach either field when they close what they open
    if "<channel|>" not in text and "<|channel>" not in text and not inside:
        assert reasoning is None


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_only_a_possible_tag_is_held_back(text: str) -> None:
    """Fed one character at a time, what is not sent yet (beside the whole parse of the text so
    far) is short: at most a tag or label less one character."""
    streaming = parser()
    reasoning = content = ""
    for i, ch in enumerate(text):
        r, c = streaming.feed(ch)
        reasoning, content = reasoning + r, content + c
        whole_r, whole_c = parser().parse(text[: i + 1])
        whole_r, whole_c = whole_r or "", whole_c or ""
        assert whole_r.startswith(reasoning) and whole_c.startswith(content)
        held = whole_r[len(reasoning):] + whole_c[len(content):]
        assert len(held) < len("<|turn>model\n"), (text[: i + 1], held)


def test_tags_split_across_deltas() -> None:
    streaming = parser()
    got = [streaming.feed(d) for d in ["<|chan", "nel>tho", "ught", "\npl", "an<chan", "nel|>an",
                                       "swer <", "|channel>", "thought\n", "<channel|>!"]]
    assert got == [("", ""), ("", ""), ("", ""), ("pl", ""), ("an", ""), ("", "an"),
                   ("", "swer "), ("", ""), ("", ""), ("", "!")]
    assert streaming.finish() == ("", "")


def test_held_text_is_flushed_into_its_field() -> None:
    streaming = parser()
    assert streaming.feed("<|channel>thought\nplan<chan") == ("plan", "")
    assert streaming.finish() == ("<chan", "")
    streaming = parser()
    assert streaming.feed("answer <|cha") == ("", "answer ")
    assert streaming.finish() == ("", "<|cha")


@pytest.mark.parametrize(("prompt", "inside"), [
    # generation prompts of llama.cpp's test_template_generation_prompt (l.7023-7032)
    ("<|turn>user\nHello<turn|>\n<|turn>model\n", False),
    ("<|turn>model\n<|channel>thought\nI'm thinking<channel|>Hello, ", False),
    ("<|turn>model\n<|channel>thought\nI'm", True),
    ("<tool_response|><|channel>thought\nI'm", True),
    # the 31B template with enable_thinking=False ends the prompt in an empty section
    ("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", False),
    # a user's `<think>` is text to Gemma 4
    ("<|turn>user\nwhat does <think> do?<turn|>\n<|turn>model\n", False),
])
def test_prompt_ends_in_reasoning(prompt: str, inside: bool) -> None:
    assert prompt_ends_in_reasoning(prompt, "gemma4") is inside


def test_qwen_prompts_read_their_own_tags() -> None:
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n", "qwen3")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n", "gemma4")


def chat_events(chat: ChatStreamParser, text: str, cuts: list[int]) -> list[ChatEvent]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {len(text)})
    events: list[ChatEvent] = []
    for a, b in zip([0, *points[:-1]], points, strict=True):
        events += chat.feed(text[a:b], is_final=b == len(text))
    return events


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_through_the_chat_stream_parser(cuts: list[int]) -> None:
    text = LLAMA_CPP_VECTORS[5][0]
    events = chat_events(ChatStreamParser(parser(), None), text, cuts)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert (reasoning, content) == ("", ANSWER)
    whole = ChatStreamParser(parser(), None).parse(text)
    assert (whole.reasoning, whole.content, whole.tool_calls) == (None, ANSWER, [])
    # without a reasoning parser the text is content as the model wrote it
    # (llama.cpp's "reasoning_format = none" vector)
    plain = "<|channel>thought\nI'm\nthinking<channel|>" + ANSWER
    assert ChatStreamParser(None, None).parse(plain).content == plain

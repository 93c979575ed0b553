"""Reasoning parsers: streamed deltas add up to the non-streamed split however the text is
chunked, nothing sent is ever taken back, tags split across deltas are found, and the worked
examples from vLLM's `qwen3` and `deepseek_r1` parsers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    make_reasoning_parser,
    prompt_ends_in_reasoning,
)

PIECES = ["<think>", "</think>", "\n", " ", "hello", "世界", "🦜", "<", "</", "think", ">",
          "<th", "ink>", "</thi", "nk>", "<think", "</think"]
# the `<think>` parsers (gemma4's tags and rules: test_gemma4_reasoning.py; openai_gptoss's
# channels: test_harmony.py)
CONFIGS = [(name, inside) for name in REASONING_PARSERS if name not in ("gemma4", "openai_gptoss")
           for inside in (False, True)]

texts = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(alphabet="<>/thinkab \n世🦜", max_size=4)),
    max_size=12,
).map("".join)


def split(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at the given points (taken modulo its length + 1, in order)."""
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def stream(parser: ReasoningParser, deltas: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    """Feeds the deltas and finishes; returns the totals and the fields sent before finish()
    after each delta."""
    reasoning = content = ""
    sent: list[tuple[str, str]] = []
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning, content = reasoning + r, content + c
        sent.append((reasoning, content))
    r, c = parser.finish()
    return reasoning + r, content + c, sent


@pytest.mark.parametrize(("name", "inside"), CONFIGS)
@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_streamed_equals_parse_and_nothing_is_taken_back(
    name: str, inside: bool, text: str, cuts: list[int]
) -> None:
    deltas = split(text, cuts)
    assert "".join(deltas) == text
    reasoning, content, sent = stream(make_reasoning_parser(name, inside), deltas)
    expected = make_reasoning_parser(name, inside).parse(text)
    assert (reasoning or None, content or None) == expected
    for so_far_reasoning, so_far_content in sent:  # every prefix sent is kept in the end
        assert reasoning.startswith(so_far_reasoning)
        assert content.startswith(so_far_content)
    # The fields are the text less the delimiting tags (and whitespace before an opening one).
    assert len(reasoning) + len(content) <= len(text)


@pytest.mark.parametrize(("name", "inside"), CONFIGS)
@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_only_what_is_still_ambiguous_is_held_back(name: str, inside: bool, text: str) -> None:
    """Fed one character at a time, what is not sent yet (compared with `parse` of the text so
    far) is only a possible tag: whitespace and a partial `<think>` at the very start, or a
    partial `</think>` at the end of the reasoning. Content is never held."""
    parser = make_reasoning_parser(name, inside)
    reasoning = content = ""
    for i, ch in enumerate(text):
        r, c = parser.feed(ch)
        reasoning, content = reasoning + r, content + c
        whole_r, whole_c = make_reasoning_parser(name, inside).parse(text[: i + 1])
        whole_r, whole_c = whole_r or "", whole_c or ""
        assert whole_r.startswith(reasoning)
        assert whole_c.startswith(content)
        held_r, held_c = whole_r[len(reasoning):], whole_c[len(content):]
        assert not (held_r and held_c)
        held = held_r + held_c
        at_start = not reasoning and not content and text[: i + 1].endswith(held)
        assert (
            not held
            or (at_start and "<think>".startswith(held.lstrip()) and held.lstrip() != "<think>")
            or (held_r and not content and "</think>".startswith(held_r) and held_r != "</think>")
        ), (text[: i + 1], reasoning, content, held)


EXAMPLES = [
    ("qwen3", False, "<think>plan</think>answer", ("plan", "answer")),
    ("qwen3", True, "plan</think>answer", ("plan", "answer")),
    ("qwen3", False, "just an answer", (None, "just an answer")),
    ("qwen3", False, "", (None, None)),
    ("qwen3", False, "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    ("qwen3", False, "\n <think>plan</think>answer", ("plan", "answer")),
    ("qwen3", False, "<think>still thinking", ("still thinking", None)),
    ("qwen3", False, "answer <think>x</think>y", (None, "answer <think>x</think>y")),
    ("qwen3", False, "</think>answer", (None, "</think>answer")),
    ("qwen3", False, "<thin", (None, "<thin")),
    ("qwen3", True, "<think>plan</think>answer", ("plan", "answer")),
    ("qwen3", True, "unfinished thought", ("unfinished thought", None)),
    ("deepseek_r1", False, "plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", True, "plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", False, "unfinished thought", ("unfinished thought", None)),
    ("deepseek_r1", False, "<think>plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", False, "a<think>b</think>c", ("a<think>b", "c")),
    ("deepseek_r1", False, "</think>answer", (None, "answer")),
    ("deepseek_r1", False, "plan</think>a</think><think>b", ("plan", "a</think><think>b")),
    ("deepseek_r1", False, "plan</thi", ("plan</thi", None)),
]


@pytest.mark.parametrize(("name", "inside", "text", "expected"), EXAMPLES)
def test_worked_examples(
    name: str, inside: bool, text: str, expected: tuple[str | None, str | None]
) -> None:
    assert make_reasoning_parser(name, inside).parse(text) == expected
    reasoning, content, _ = stream(make_reasoning_parser(name, inside), list(text))
    assert (reasoning or None, content or None) == expected


def test_tags_split_across_deltas() -> None:
    parser = make_reasoning_parser("qwen3", False)
    got = [parser.feed(d) for d in ["<th", "ink>pl", "an</thi", "nk>ans"]]
    assert got == [("", ""), ("pl", ""), ("an", ""), ("", "ans")]
    assert parser.finish() == ("", "")
    assert parser.parse("<think>plan</think>ans") == ("plan", "ans")


def test_partial_tag_is_held_then_flushed_as_text_of_its_field() -> None:
    parser = make_reasoning_parser("deepseek_r1", False)
    assert parser.feed("plan</th") == ("plan", "")
    assert parser.finish() == ("</th", "")
    parser = make_reasoning_parser("qwen3", False)
    assert parser.feed("\n<thi") == ("", "")
    assert parser.finish() == ("", "\n<thi")
    parser = make_reasoning_parser("qwen3", False)
    assert parser.feed("<think>a</think>b<") == ("a", "b<")  # content is never held


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match=r"'granite'.*qwen3.*deepseek_r1"):
        make_reasoning_parser("granite", False)


@pytest.mark.parametrize(("prompt", "inside"), [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<|im_start|>assistant\n", False),
    ("<think>a</think> earlier turn <think>", True),
    ("", False),
])
def test_prompt_ends_in_reasoning(prompt: str, inside: bool) -> None:
    assert prompt_ends_in_reasoning(prompt) is inside

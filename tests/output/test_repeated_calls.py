"""A forced call list ends at an exact repeat (`output/repeats.py`): the text is cut after the
last new call, the engine request is to be aborted, a stream never shows the repeat, and
calls that only begin alike are kept. Driven by the real tokenizer, token by token, through the
output processor as the server runs it; the whole-list cases also by hypothesis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_streaming_text import stream

from nanoserve.output.repeats import RepeatedItemChecker
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

TIME = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
TIME_SPACED = '{\n  "name": "get_time"\n\n,"parameters": {\n    "zone": "UTC"\n}\n}'
TOKYO = '{"name": "get_time", "parameters": {"zone": "UTC Tokyo"}}'
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" [x]"}}'


def call_list_params(kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(max_tokens=500, is_call_list=True, output_kind=kind)


@pytest.mark.parametrize(("text", "kept"), [
    (f"[{TIME}, {TIME}, {WEATHER}]", f"[{TIME}"),
    # whitespace between tokens makes no difference
    (f"[{TIME},\n\n{TIME_SPACED}, {WEATHER}]", f"[{TIME}"),
    (f"[{WEATHER}, {TIME}, {WEATHER}, {TOKYO}]", f"[{WEATHER}, {TIME}"),
])
def test_a_repeat_ends_the_list_after_the_last_new_call(default_tokenizer: Any, text: str,
                                                        kept: str) -> None:
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    deltas, final, is_stopped = stream(default_tokenizer, [1], ids,
                                       call_list_params(RequestOutputKind.DELTA))
    assert is_stopped  # the caller aborts the engine request: no more tokens go to it
    assert "".join(deltas) == kept and final.outputs[0].finish_reason == "stop"
    _, whole, _ = stream(default_tokenizer, [1], ids,
                         call_list_params(RequestOutputKind.FINAL_ONLY))
    assert whole.outputs[0].text == kept and whole.outputs[0].finish_reason == "stop"
    kept_calls = [json.dumps(call) for call in json.loads(kept + "]")]
    assert kept_calls and len(set(kept_calls)) == len(kept_calls)


@pytest.mark.parametrize("text", [
    f"[{TIME}, {TOKYO}]",  # the same tool, other arguments: both are wanted
    f"[{TIME}, {WEATHER}]",
    f'[{TIME}, {TIME.replace("UTC", "utc")}]',  # strings differ in case
    f'[{TIME}, {TIME.replace("UTC", "U TC")}]',  # whitespace inside a string counts
])
def test_calls_that_differ_are_all_kept(default_tokenizer: Any, text: str) -> None:
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        deltas, final, is_stopped = stream(default_tokenizer, [1], ids, call_list_params(kind))
        assert not is_stopped
        assert final.outputs[0].finish_reason == "length"  # the engine's own reason stands
        assert ("".join(deltas) if kind == RequestOutputKind.DELTA
                else final.outputs[0].text) == text


def test_a_stream_holds_back_a_call_that_may_be_a_repeat(default_tokenizer: Any) -> None:
    """While the second call matches the first so far, nothing of it (nor its comma) is sent;
    once it differs, it all goes."""
    text = f"[{TIME}, {TOKYO}]"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    deltas, _, _ = stream(default_tokenizer, [1], ids,
                          call_list_params(RequestOutputKind.DELTA))
    sent = ""
    for delta in deltas:
        sent += delta
        if len(sent) > len(f"[{TIME}") and not sent.startswith(f"[{TIME}, {TOKYO[:-14]}"):
            pytest.fail(f"sent the second call's start before it differed: {sent!r}")
    assert sent == text


def test_without_the_flag_nothing_is_cut(default_tokenizer: Any) -> None:
    text = f"[{TIME}, {TIME}]"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    _, final, is_stopped = stream(default_tokenizer, [1], ids,
                                  SamplingParams(max_tokens=500,
                                                 output_kind=RequestOutputKind.FINAL_ONLY))
    assert not is_stopped and final.outputs[0].text == text


names = st.sampled_from(["a", "b", "get_time"])
arguments = st.dictionaries(st.sampled_from(["x", "y"]),
                            st.one_of(st.integers(0, 2), st.text("ab ,]}\"\\", max_size=3)),
                            max_size=2)
calls = st.lists(st.fixed_dictionaries({"name": names, "parameters": arguments}), min_size=1,
                 max_size=5)


@settings(max_examples=200, deadline=None)
@given(calls, st.sampled_from([None, 2]))
def test_the_cut_keeps_the_calls_before_the_first_repeat(items: list[dict[str, Any]],
                                                         indent: int | None) -> None:
    text = "[" + ", ".join(json.dumps(item, indent=indent) for item in items) + "]"
    checker = RepeatedItemChecker()
    cut = None
    for end in range(1, len(text) + 1):  # a character at a time, as tokens may split them
        cut = checker.scan(text[:end])
        if cut is not None:
            break
    seen: list[str] = []  # an exact repeat: the same JSON, keys in the same order
    for item in items:
        if json.dumps(item) in seen:
            break
        seen.append(json.dumps(item))
    if len(seen) == len(items):
        assert cut is None
    else:
        assert cut is not None
        assert [json.dumps(item) for item in json.loads(text[:cut] + "]")] == seen


@pytest.mark.parametrize(("after_reasoning", "reasoning"), [
    ("inside", 'weigh [{"a": 1}, {"a": 1}] and {x} first</think>\n'),
    ("opening", '\n<think>weigh [{"a": 1}, {"a": 1}] first</think>\n'),
    ("opening", ""),  # no section opened: the list is the whole output
])
def test_a_list_after_the_reasoning_is_scanned_from_its_start(
        after_reasoning: str, reasoning: str) -> None:
    """Where the grammar starts after the reasoning, the list is the text after `</think>`:
    brackets and repeats inside the reasoning are not the list's."""
    text = reasoning + f"[{TIME}, {TIME}]"
    checker = RepeatedItemChecker(after_reasoning)
    cut = None
    for end in range(1, len(text) + 1):
        cut = checker.scan(text[:end])
        if cut is not None:
            break
    assert cut is not None and text[:cut] == reasoning + f"[{TIME}"

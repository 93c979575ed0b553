"""Streaming text: deltas add up to the final text, the final text is a plain decode cut at the
first stop string, nothing sent is ever taken back, streamed equals non-streamed. Driven by
the real tokenizer with engine outputs made up token by token (no model needed)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanoserve.output.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    _OffsetStream,
    decode_text,
)
from nanoserve.output.processor import OutputProcessor
from nanoserve.protocol import EngineCoreOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PIECES = ["hello", " world", "the", " ", "\n", "42", "。", "：", "鹦鹉", "说", "答案是", "解释",
          "如下", "🦜", "👍🏽", "👨‍👩‍👧", "é", "e\u0301", "naïve", "Zoë", "\t", "ÿ", "中文"]
_ids = itertools.count()


def first_stop(text: str, stops: list[str], include: bool) -> str:
    """The plain definition: cut at the first stop string to complete (earliest end)."""
    best = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or (at + len(stop), at) < best[0]):
            best = ((at + len(stop), at), stop)
    if best is None:
        return text
    (end, start), _ = best
    return text[:end] if include else text[:start]


def stream(tokenizer: Any, prompt_ids: list[int], output_ids: list[int],
           params: SamplingParams, chunk: int = 1) -> tuple[list[str], Any, bool]:
    """Feed `output_ids` `chunk` at a time; -> deltas, final output, whether it stopped early."""
    processor = OutputProcessor(tokenizer)
    request_id = f"t{next(_ids)}"
    processor.add_request(request_id, None, prompt_ids, params)
    deltas: list[str] = []
    final = None
    for start in range(0, len(output_ids), chunk):
        last = start + chunk >= len(output_ids)
        eo = EngineCoreOutput(request_id, output_ids[start : start + chunk],
                              "length" if last else None)
        result = processor.process([eo])
        for out in result.outputs:
            deltas.append(out.outputs[0].text)
            final = out
        if result.to_abort:
            return deltas, final, True
    return deltas, final, False


texts = st.lists(st.one_of(st.sampled_from(PIECES), st.sampled_from(SPECIALS),
                           st.text(min_size=1, max_size=3)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(texts, st.lists(st.text(min_size=1, max_size=4), max_size=2), st.booleans(),
       st.booleans(), st.booleans(), st.integers(1, 3), st.data())
def test_streamed_text_properties(default_tokenizer: Any, pieces: list[str],
                                  random_stops: list[str], skip_special: bool, spaces: bool,
                                  include: bool, chunk: int, data: st.DataObject) -> None:
    tokenizer = default_tokenizer
    text = "".join(pieces)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    # a step emits at least one token: text the tokenizer drops entirely (a lone "\x1d"
    # encodes to no ids) is no output to stream
    assume(output_ids)
    plain = decode_text(tokenizer, output_ids, skip_special, spaces)
    # stop strings: some that occur in the decoded text, some random
    picks = data.draw(st.lists(st.tuples(st.integers(0, max(len(plain) - 1, 0)),
                                         st.integers(1, 4)), max_size=2))
    stops = [plain[a : a + n] for a, n in picks if plain[a : a + n]] + random_stops
    prompt_ids = tokenizer.encode("Prompt: ", add_special_tokens=False)
    params = SamplingParams(stop=stops or None, include_stop_str_in_output=include,
                            skip_special_tokens=skip_special,
                            spaces_between_special_tokens=spaces, max_tokens=1000,
                            output_kind=RequestOutputKind.DELTA)
    deltas, final, _ = stream(tokenizer, prompt_ids, output_ids, params, chunk)
    assert final is not None and final.finished
    expected = first_stop(plain, stops, include)
    assert "".join(deltas) == expected  # (in DELTA mode each update holds only what is new)
    sent = ""
    for delta in deltas:  # nothing sent is ever taken back; no stray replacement characters
        sent += delta
        assert expected.startswith(sent)
        if REPLACEMENT not in plain:
            assert REPLACEMENT not in delta
    # streamed and not streamed agree
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        other = SamplingParams(stop=stops or None, include_stop_str_in_output=include,
                               skip_special_tokens=skip_special,
                               spaces_between_special_tokens=spaces, max_tokens=1000,
                               output_kind=kind)
        _, other_final, _ = stream(tokenizer, prompt_ids, output_ids, other, chunk)
        assert other_final.outputs[0].text == expected


def test_textbook_example_holds_back_and_cuts(default_tokenizer: Any) -> None:
    text = "鹦鹉🦜说：答案是42。\n解释如下"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["\n解释"], max_tokens=100,
                            output_kind=RequestOutputKind.DELTA)
    deltas, final, stopped = stream(default_tokenizer, [], ids, params)
    assert stopped
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "\n解释"
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == "鹦鹉🦜说：答案是42。"


@pytest.mark.parametrize("fast", [True, False])
def test_prompt_ending_mid_character_leaks_nothing(default_tokenizer: Any, fast: bool) -> None:
    ids = default_tokenizer.encode("鹦鹉🦜说", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]  # the prompt holds the first byte of 鹦
    assert default_tokenizer.decode(prompt).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(default_tokenizer, prompt)
    if not fast:
        detok._stream = _OffsetStream(default_tokenizer, prompt, True)
    deltas = [detok.update([t]) for t in output]
    assert "".join(deltas) == "鹉🦜说"  # 鹦 belongs to the prompt
    assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_offset_stream_fallback_matches_decode(default_tokenizer: Any, skip: bool) -> None:
    ids = default_tokenizer.encode("Hi <|im_end|> 鹦鹉🦜说：答案是42。 naïve e\u0301",
                                   add_special_tokens=False)
    stream_ = _OffsetStream(default_tokenizer, [], skip)
    assert "".join(stream_.step(t) for t in ids) == default_tokenizer.decode(
        ids, skip_special_tokens=skip)


def test_special_tokens_spaced_like_slow_tokenizers(default_tokenizer: Any) -> None:
    ids = default_tokenizer.encode("<|im_start|>user\nhi<|im_end|><|im_end|>",
                                   add_special_tokens=False)
    spaced = IncrementalDetokenizer(default_tokenizer, [], False, True)
    assert "".join(spaced.update([t]) for t in ids) == \
        "<|im_start|> user\nhi <|im_end|> <|im_end|>"
    tight = IncrementalDetokenizer(default_tokenizer, [], False, False)
    assert "".join(tight.update([t]) for t in ids) == "<|im_start|>user\nhi<|im_end|><|im_end|>"


def test_stop_token_text_is_left_out_unless_asked(default_tokenizer: Any) -> None:
    ids = default_tokenizer.encode("Hello world", add_special_tokens=False)
    for include, expected in ((False, "Hello"), (True, "Hello world")):
        processor = OutputProcessor(default_tokenizer)
        processor.add_request("s", None, [], SamplingParams(
            stop_token_ids=[ids[-1]], include_stop_str_in_output=include))
        processor.process([EngineCoreOutput("s", ids[:-1])])
        out = processor.process([EngineCoreOutput("s", ids[-1:], "stop", ids[-1])]).outputs[0]
        assert out.outputs[0].text == expected and out.outputs[0].stop_reason == ids[-1]


def test_min_tokens_defers_stop_strings(default_tokenizer: Any) -> None:
    ids = default_tokenizer.encode("a b a b a b a", add_special_tokens=False)
    assert len(ids) == 7  # "a", " b", " a", " b", ...
    processor = OutputProcessor(default_tokenizer)
    processor.add_request("m", None, [], SamplingParams(stop=["b"], min_tokens=4,
                                                        max_tokens=50))
    count = 0
    for token in ids:
        count += 1
        result = processor.process([EngineCoreOutput("m", [token])])
        if result.to_abort:
            break
    # the "b" of token 2 came before min_tokens; the one of token 4 ends the request
    assert count == 4 and result.outputs[0].outputs[0].text == "a b a "

"""The offline API: vLLM-shaped inputs and outputs, chat templates, streaming."""

from __future__ import annotations

from typing import Any

import pytest

from nanoserve import LLM, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir("qwen3")), device="cpu", kv_cache_memory_gb=0.05)


def test_generate_accepts_vllm_prompt_shapes_and_keeps_order(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("a b c")
    outs = llm.generate(["hello there", {"prompt_token_ids": ids}, {"prompt": "x y"}], GREEDY,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello there", None, "x y"]
    assert outs[1].prompt_token_ids == ids
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("hello there")
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids,
                                                             skip_special_tokens=True)
        assert out.metrics is not None and out.metrics.time_to_first_token is not None
        assert out.metrics.e2e_latency >= out.metrics.time_to_first_token
    # a single string gives a one-element list, equal to the batched result
    assert llm.generate("hello there", GREEDY)[0].outputs[0].token_ids == \
        outs[0].outputs[0].token_ids


def test_one_params_per_prompt(llm: LLM) -> None:
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, temperature=0),
                                     SamplingParams(max_tokens=5, temperature=0,
                                                    ignore_eos=True)], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) <= 2 and len(outs[1].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"text": "no"}], GREEDY)


def test_stop_token_ids_finish_with_stop(llm: LLM) -> None:
    first = llm.generate("hello", GREEDY)[0].outputs[0].token_ids
    stop_at = first[2]
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=6,
                                               stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == first[: first.index(stop_at) + 1]


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, GREEDY)[0]
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
    assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    two = llm.chat([messages, [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_stream_yields_the_same_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pieces = list(llm.stream("streaming works", params))
    assert "".join(pieces) == llm.generate("streaming works", params)[0].outputs[0].text
    # closing early aborts the request and frees its blocks
    stream = llm.stream("streaming works", params)
    next(stream, None)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_too_long_prompt_is_refused_and_the_engine_stays_clean(tiny_model_dir: Any) -> None:
    small = LLM(str(tiny_model_dir("llama")), device="cpu", max_model_len=32,
                kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        small.generate(["fine", {"prompt_token_ids": list(range(3, 40))}], GREEDY)
    assert not small.engine.has_unfinished()
    assert small.generate("fine", GREEDY)[0].finished


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)

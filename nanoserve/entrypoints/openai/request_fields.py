"""The body fields both OpenAI generating endpoints share (`protocol.SamplingFields`),
translated into the neutral `chat_input` types: the sampling fields and the response format.
The translation checks nothing (see `chat_input.py`)."""

from __future__ import annotations

from nanoserve.entrypoints.openai.protocol import SamplingFields
from nanoserve.entrypoints.serving.chat_input import (
    ResponseFormatInput,
    SamplingInput,
    StreamOptions,
)
from nanoserve.entrypoints.serving.llama_sampler_fields import llama_samplers


def sampling_input(req: SamplingFields, *, max_tokens: int | None,
                   logprobs: int | None) -> SamplingInput:
    """`max_tokens`, `logprobs`: as the endpoint reads them (their fields differ)."""
    options = req.stream_options
    return SamplingInput(
        n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
        logit_bias=req.logit_bias, logprobs=logprobs,
        # (an extra top_logprobs field on a completions body renames it too, as it always did)
        logprobs_field="top_logprobs" if hasattr(req, "top_logprobs") else "logprobs",
        prompt_logprobs=req.prompt_logprobs, logprobs_mode=req.logprobs_mode,
        thinking_token_budget=req.thinking_token_budget, extra_args=req.extra_args,
        cache_salt=req.cache_salt, return_progress=req.return_progress, priority=req.priority,
        llama_samplers=llama_samplers(req),
        stream=req.stream,
        stream_options=None if options is None else StreamOptions(
            options.include_usage, options.continuous_usage_stats))


def response_format_input(req: SamplingFields) -> ResponseFormatInput:
    return ResponseFormatInput(
        response_format=req.response_format, structured_outputs=req.structured_outputs,
        guided_json=req.guided_json, guided_regex=req.guided_regex,
        guided_choice=req.guided_choice, guided_grammar=req.guided_grammar,
        guided_whitespace_pattern=req.guided_whitespace_pattern)

"""A request's SamplingParams: its sampling fields (`chat_input.SamplingInput`) over the
model's generation defaults, with 400s that name the field, the value and the allowed range."""

from __future__ import annotations

from nanoserve.config import check_priority
from nanoserve.entrypoints.serving.chat_input import SamplingInput
from nanoserve.entrypoints.serving.errors import bad_request, from_value_error
from nanoserve.entrypoints.serving.limits import check_bad_words, check_stops
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


def sampling_params(ctx: ServerContext, fields: SamplingInput, *, max_tokens: int,
                    output_kind: RequestOutputKind,
                    structured: StructuredOutputsParams | None = None,
                    is_call_list: bool = False) -> SamplingParams:
    """The request's SamplingParams, built and checked once and carried to the engine as they
    are: explicit fields over the model's generation defaults, the resolved output budget, the
    grammar (`structured`, from the response format or a tool plan) and whether the output is
    a forced list of calls."""
    if fields.stream_options is not None and not fields.stream:
        raise bad_request("stream_options can only be given when stream is true",
                          "stream_options")
    if fields.stream and fields.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available when streaming", "prompt_logprobs")
    _check_temperature(fields)
    check_stops(ctx.limits, fields.stop)
    check_bad_words(ctx.limits, fields.bad_words)
    try:
        bias = None if fields.logit_bias is None else {
            int(k): v for k, v in fields.logit_bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)",
                          "logit_bias") from None
    explicit = dict(
        n=fields.n, temperature=fields.temperature, top_p=fields.top_p, top_k=fields.top_k,
        min_p=fields.min_p, repetition_penalty=fields.repetition_penalty,
        presence_penalty=fields.presence_penalty, frequency_penalty=fields.frequency_penalty,
        seed=None if fields.seed == -1 else fields.seed, stop=fields.stop,
        stop_token_ids=fields.stop_token_ids or [], ignore_eos=fields.ignore_eos,
        min_tokens=fields.min_tokens, max_tokens=max_tokens,
        skip_special_tokens=fields.skip_special_tokens,
        spaces_between_special_tokens=fields.spaces_between_special_tokens,
        include_stop_str_in_output=fields.include_stop_str_in_output,
        allowed_token_ids=fields.allowed_token_ids, bad_words=fields.bad_words,
        logit_bias=bias, logprobs=fields.logprobs,
        prompt_logprobs=(fields.prompt_logprobs if fields.prompt_logprobs is not None
                         else fields.echo_logprobs),
        logprobs_mode=fields.logprobs_mode, thinking_token_budget=fields.thinking_token_budget,
        extra_args=fields.extra_args, cache_salt=fields.cache_salt, output_kind=output_kind,
        # only a stream can send progress (llama-server ignores it otherwise too)
        return_progress=fields.return_progress and fields.stream,
        structured_outputs=structured, is_call_list=is_call_list, priority=fields.priority,
        **fields.llama_samplers)
    try:
        check_priority(fields.priority, ctx.engine.ready.scheduling_policy)
        params = SamplingParams.from_generation_config(ctx.generation_defaults, **explicit)
        params.check_limits(ctx.vocab_size, ctx.max_logprobs, fields.logprobs_field)
        for cls in ctx.processor_classes:
            cls.validate_params(params)
    except ValueError as e:
        error = from_value_error(e)
        if "priority" in str(e):
            error.param = "priority"
        raise error from None
    if params.thinking_token_budget is not None and not ctx.has_reasoning_tokens:
        raise bad_request("thinking_token_budget needs a model with reasoning tags "
                          "(<think> and </think> tokens); this model has none",
                          "thinking_token_budget")
    if params.bad_words or params.uses_dry:  # their words as token ids
        params.update_from_tokenizer(ctx.tokenizer)
    return params


def _check_temperature(fields: SamplingInput) -> None:
    """A wire format that documents a cap on `temperature` gets it (OpenAI's Responses 2,
    Anthropic's Messages 1, as their own APIs answer 400 above it); chat completions and
    completions keep vLLM's range, which has none. The lower bound is SamplingParams'."""
    cap, value = fields.max_temperature, fields.temperature
    if cap is not None and value is not None and value > cap:
        raise bad_request(f"temperature must be in [0, {cap:g}] on this API, got {value:g}",
                          "temperature")

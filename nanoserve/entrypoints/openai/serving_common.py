"""What /v1/completions and /v1/chat/completions share: the server's context, turning a body
into SamplingParams (with 400s that name the field), length checks, logprobs, usage."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from nanoserve.config import RequestLimits
from nanoserve.entrypoints.async_engine import AsyncEngine, EngineDeadError, RequestTimeoutError
from nanoserve.entrypoints.openai.errors import APIError, bad_request, from_value_error, sse_error
from nanoserve.entrypoints.openai.limits import check_bad_words, check_n, check_stops
from nanoserve.entrypoints.openai.metrics import Metrics
from nanoserve.entrypoints.openai.protocol import SamplingFields
from nanoserve.outputs import Logprob, PositionLogprobs, RequestOutput
from nanoserve.sample.logits_processor import LogitsProcessor
from nanoserve.sampling_params import RequestOutputKind, SamplingParams
from nanoserve.structured.grammar import GrammarTokenizer

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # OpenAI's stand-in for -inf


@dataclass
class ServerContext:
    """Everything a request handler needs, built once when the server starts."""

    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: Metrics
    max_logprobs: int  # the engine's cap (EngineArgs.max_logprobs)
    max_in_flight: int  # past this many sequences (requests times n) in flight: 429
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # --tool-call-parser: what `tool_choice="auto"` reads
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's own
    processor_classes: list[type[LogitsProcessor]] = field(default_factory=list)
    has_reasoning_tokens: bool = False
    # the model's tokenizer as llguidance's, for the grammar checks (built on first use)
    grammar_tokenizer: GrammarTokenizer | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutting_down: bool = False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_capacity(self, num_prompts: int = 1, n: int = 1) -> None:
        """429 past the in-flight cap (the SDK backs off and retries); 503 while stopping.
        The cap counts engine sequences: each of a /v1/completions batch's prompts, times n
        (each sample holds its own copy of the prompt: 512 requests of n=128 on 8k-token
        prompts would need ~24 GiB in the engine alone)."""
        if self.engine.is_dead:
            raise APIError(503, "the engine is not running")
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if num_prompts > self.max_in_flight:
            raise bad_request(f"prompt must be a batch of at most {self.max_in_flight} prompts "
                              f"(--max-in-flight), got {num_prompts}", "prompt")
        check_n(self.limits, n)
        if num_prompts * n > self.max_in_flight:
            raise bad_request(f"n times the prompts must be at most {self.max_in_flight} "
                              f"sequences (--max-in-flight), got {n} x {num_prompts}", "n")
        if self.engine.num_sequences_in_flight + num_prompts * n > self.max_in_flight:
            raise APIError(429, f"the server is at capacity ({self.max_in_flight} sequences "
                                "in flight); retry later")


def sampling_params(ctx: ServerContext, req: SamplingFields, *, max_tokens: int,
                    logprobs: int | None, output_kind: RequestOutputKind) -> SamplingParams:
    """The request's SamplingParams: explicit fields over the model's generation defaults."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true",
                          "stream_options")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available when streaming", "prompt_logprobs")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    check_stops(ctx.limits, stops)
    check_bad_words(ctx.limits, req.bad_words)
    try:
        bias = None if req.logit_bias is None else {int(k): v for k, v in req.logit_bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)",
                          "logit_bias") from None
    explicit = dict(
        n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=None if req.seed == -1 else req.seed, stop=stops,
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, max_tokens=max_tokens,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, logit_bias=bias,
        logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
        logprobs_mode=req.logprobs_mode, thinking_token_budget=req.thinking_token_budget,
        extra_args=req.extra_args, output_kind=output_kind)
    try:
        params = SamplingParams.from_generation_config(ctx.generation_defaults, **explicit)
        params.check_token_ids(ctx.vocab_size)
        for cls in ctx.processor_classes:
            cls.validate_params(params)
    except ValueError as e:
        raise from_value_error(e) from None
    # the request's own name for the count: chat's top_logprobs, completions' logprobs
    field_of = {"logprobs": "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs",
                "prompt_logprobs": "prompt_logprobs"}
    for name, field_name in field_of.items():
        asked = getattr(params, name)
        if asked is not None and asked > ctx.max_logprobs:
            raise bad_request(f"{field_name} must be <= {ctx.max_logprobs} (--max-logprobs), "
                              f"got {asked}", field_name)
    if params.thinking_token_budget is not None and not ctx.has_reasoning_tokens:
        raise bad_request("thinking_token_budget needs a model with reasoning tags "
                          "(<think> and </think> tokens); this model has none",
                          "thinking_token_budget")
    if params.bad_words:
        params.update_from_tokenizer(ctx.tokenizer)
    return params


def resolve_max_tokens(ctx: ServerContext, prompt_len: int, asked: int | None) -> int:
    """vLLM's checks and messages; without max_tokens, generation may fill the context."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input messages.",
            "input_tokens")
    if asked is None:
        return limit - prompt_len
    if asked < 1:
        raise bad_request(f"max_tokens must be >= 1, got {asked}", "max_tokens")
    if prompt_len + asked > limit:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's "
            f"maximum context length is {limit} tokens and your request has {prompt_len} "
            f"input tokens ({asked} > {limit} - {prompt_len}).", "max_tokens")
    return asked


def check_prompt_ids(ctx: ServerContext, ids: list[int]) -> None:
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"prompt token id {bad[0]} is out of vocabulary "
                          f"(ids must be in [0, {ctx.vocab_size}))", "prompt")


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isinf(value) or value < MIN_LOGPROB else value


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chosen(position: PositionLogprobs, token_id: int) -> Logprob:
    return position[token_id]


def top_entries(position: PositionLogprobs, count: int) -> list[tuple[int, Logprob]]:
    """The top `count` alternatives, best first (the chosen token only where it ranks)."""
    ranked = sorted(((t, lp) for t, lp in position.items() if lp.rank is not None),
                    key=lambda item: item[1].rank or 0)
    out: list[tuple[int, Logprob]] = []
    for token_id, lp in ranked:
        if lp.rank is not None and lp.rank <= count and all(t != token_id for t, _ in out):
            out.append((token_id, lp))
    return out[:count]


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its engine
    requests) and answer nothing."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()


async def collect(generator: Any) -> RequestOutput:
    """The final RequestOutput of a FINAL_ONLY request."""
    final = None
    async for output in generator:
        final = output
    assert final is not None
    return final


async def sse_with_errors(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A stream's events, then `data: [DONE]`. An error after the stream has started (the 200
    is already sent) becomes one `data: {"error": ...}` event, as OpenAI's clients expect."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield sse_error(e)
    except EngineDeadError as e:
        yield sse_error(APIError(503, f"the engine stopped: {e}"))
    except RequestTimeoutError as e:
        yield sse_error(APIError(408, str(e)))
    except ValueError as e:
        yield sse_error(bad_request(str(e)))
    finally:
        await events.aclose()  # (a client that went away: its requests are aborted now)
    yield "data: [DONE]\n\n"

"""A request's token counts against the model: the prompt's ids against the vocabulary, and
the prompt plus `max_tokens` against the context length (vLLM's checks and messages)."""

from __future__ import annotations

from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.server_context import ServerContext


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

"""A request's token counts against the model: the prompt's ids against the vocabulary, and
the prompt plus `max_tokens` against the context length (vLLM's checks and messages)."""

from __future__ import annotations

from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.server_context import ServerContext


def resolve_max_tokens(ctx: ServerContext, prompt_len: int, asked: int | None, *,
                       is_cap: bool = False, context_limit: int | None = None,
                       context_field: str = "num_ctx") -> int:
    """The request's output budget: `asked`, or the room the context leaves after the prompt
    without it. The one max-tokens policy of every API:

    - a prompt that leaves no room is a 400 (vLLM's message);
    - `asked` past the room is a 400 (vLLM's rule, chat completions and completions), or, where
      the wire format makes it a cap (`is_cap`: Anthropic's required `max_tokens`, Ollama's
      `num_predict`), held to the room, as those servers stop at the context's end;
    - `context_limit` (Ollama's `num_ctx`) is a smaller context for this request; one past the
      server's `--max-model-len` is held to it, as Ollama holds it to the model's.
    """
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input messages.",
            "input_tokens")
    if context_limit is not None and context_limit < limit:
        if prompt_len >= context_limit:
            raise bad_request(f"the prompt has {prompt_len} tokens, which do not fit "
                              f"{context_field} ({context_limit}); raise it or shorten the "
                              "prompt", context_field)
        limit = context_limit
    room = limit - prompt_len
    if asked is None:
        return room
    if asked < 1:
        raise bad_request(f"max_tokens must be >= 1, got {asked}", "max_tokens")
    if asked > room and is_cap:
        return room
    if asked > room:
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

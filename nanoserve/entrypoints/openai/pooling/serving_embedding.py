"""POST /v1/embeddings: one vector per input (text or token ids), from the generating engine.

Each input is a prefill-only request (`AsyncEngine.encode`): scheduled beside the decoding
requests, pooled by the engine's `--pooling` (the last token's final hidden state by default),
L2-normalized, and answered as floats or, as the openai SDK asks by default, base64 of
little-endian float32. Nothing is kept after the request.

A request may hold up to 2,048 inputs (OpenAI's own cap; LangChain sends 1,000 at a time). So
that a batch does not fill the server, at most `INPUTS_IN_ENGINE` of them are in the engine at
once, and that many count against --max-in-flight (checked when the request arrives). Each
input is held to the context length; an error names the input by its index.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from nanoserve.entrypoints.openai.pooling.protocol import EmbeddingRequest
from nanoserve.entrypoints.serving.disconnect import until_disconnect
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.outputs import PoolingRequestOutput
from nanoserve.pooling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's cap on one request's inputs
# Inputs of one request in the engine at once: the engine's default running batch
# (max_num_seqs 64), so a big batch keeps the engine busy without taking every slot.
INPUTS_IN_ENGINE = 64


def check_batch(ctx: ServerContext, count: int, field: str) -> None:
    """400 for an empty or too large batch, 429 at capacity (before anything is tokenized)."""
    if count == 0:
        raise bad_request(f"{field} must not be empty: give at least one", field)
    if count > MAX_INPUTS:
        raise bad_request(f"{field} may hold at most {MAX_INPUTS} items, got {count}", field)
    ctx.check_capacity(min(count, _window(ctx)))


def _window(ctx: ServerContext) -> int:
    """How many of one request's inputs may be in the engine at once."""
    return min(INPUTS_IN_ENGINE, ctx.max_in_flight)


def check_length(ctx: ServerContext, ids: Sequence[int], param: str, what: str) -> None:
    """An input must fit the context (all of it: pooling generates nothing after it)."""
    if len(ids) > ctx.max_model_len:
        raise bad_request(
            f"{what} has {len(ids)} tokens, but this model's maximum context length is "
            f"{ctx.max_model_len} tokens; shorten it", param)


def tokenize(ctx: ServerContext, texts: list[str]) -> list[list[int]]:
    """The texts' token ids, as /v1/completions tokenizes a prompt (one batched call)."""
    return [list(ids) for ids in ctx.tokenizer(texts)["input_ids"]] if texts else []


def _input_ids(ctx: ServerContext, value: Any) -> list[list[int]]:
    """`input` as token id lists: a text, texts, token ids or lists of token ids."""
    single = isinstance(value, str) or (bool(value) and isinstance(value[0], int))
    items: list[Any] = [value] if single else list(value)
    check_batch(ctx, len(items), "input")
    texts = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
    for i, text in texts:
        if not text:
            raise bad_request(f"input[{i}] is an empty string; every input needs text",
                              _param(single, i))
    token_ids = dict(zip((i for i, _ in texts), tokenize(ctx, [t for _, t in texts]),
                         strict=True))
    out = []
    for i, item in enumerate(items):
        ids = token_ids[i] if i in token_ids else list(item)
        if not ids:
            raise bad_request(f"input[{i}] is an empty list of token ids", _param(single, i))
        bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad:
            raise bad_request(f"input[{i}] has token id {bad[0]}, outside the vocabulary "
                              f"(ids must be in [0, {ctx.vocab_size}))", _param(single, i))
        check_length(ctx, ids, _param(single, i), f"input[{i}]")
        out.append(ids)
    return out


def _param(single: bool, index: int) -> str:
    return "input" if single else f"input.{index}"


async def pool_all(ctx: ServerContext, request_id: str, inputs: list[list[int]],
                   params: PoolingParams) -> list[PoolingRequestOutput]:
    """Every input's vector, in order, with at most INPUTS_IN_ENGINE in the engine at once
    (fewer under a smaller --max-in-flight).
    The first failure cancels (and so aborts) the rest, and is raised as it was."""
    window = asyncio.Semaphore(_window(ctx))

    async def one(i: int, ids: list[int]) -> PoolingRequestOutput:
        async with window:
            return await ctx.engine.encode(f"{request_id}-{i}", ids, params)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, ids)) for i, ids in enumerate(inputs)]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest,
                           raw: Request) -> JSONResponse:
    ctx.check_model(req.model)
    size = ctx.engine.ready.hidden_size
    if req.dimensions is not None and req.dimensions != size:
        raise bad_request(
            f"dimensions must be {size} (this model's embedding size), got {req.dimensions}: "
            "the model is not trained for shorter (Matryoshka) embeddings", "dimensions")
    inputs = _input_ids(ctx, req.input)
    request_id = f"embd-{uuid.uuid4().hex}"
    outputs = await until_disconnect(raw, pool_all(ctx, request_id, inputs, PoolingParams()))
    num_tokens = sum(len(ids) for ids in inputs)
    return JSONResponse({
        "object": "list",
        "data": [{"object": "embedding", "index": i,
                  "embedding": encode_vector(out.outputs.data, req.encoding_format)}
                 for i, out in enumerate(outputs)],
        "model": ctx.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

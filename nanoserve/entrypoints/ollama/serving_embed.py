"""POST /api/embed and the older /api/embeddings: one vector per input through the same
pooling as /v1/embeddings (`openai/pooling/serving_embedding.py`: the same tokenizing, the same
prefill-only requests, L2-normalized vectors, the same cap on inputs in the engine at once),
answered in Ollama's shapes.

- `truncate` (default true): an input past the context is cut to the context, as Ollama cuts
  it; with false it is a 400 naming the input.
- `dimensions` other than the model's embedding size is a 400, as on /v1/embeddings: none of
  the models served here is trained for shorter vectors (Ollama would cut and renormalize).
- An empty `input` ("" or []) embeds nothing and answers no vectors, as Ollama does (its way of
  loading an embedding model); an empty string among others is a 400 naming it. /api/embeddings
  with an empty `prompt` answers an empty vector, as Ollama's does.
- `options` and `keep_alive` are checked and change nothing (the model is loaded; pooling
  samples nothing).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from nanoserve.entrypoints.ollama.keep_alive import parse_keep_alive
from nanoserve.entrypoints.ollama.protocol import OllamaEmbeddingsRequest, OllamaEmbedRequest
from nanoserve.entrypoints.ollama.serving import check_model
from nanoserve.entrypoints.openai.pooling.serving_embedding import (
    check_batch,
    check_length,
    pool_all,
    tokenize,
)
from nanoserve.entrypoints.serving.disconnect import until_disconnect
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.pooling_params import PoolingParams


async def create_embed(ctx: ServerContext, req: OllamaEmbedRequest,
                       raw: Request) -> dict[str, Any]:
    started = time.monotonic()
    check_model(ctx, req.model)
    parse_keep_alive(req.keep_alive)
    size = ctx.engine.ready.hidden_size
    if req.dimensions is not None and req.dimensions != size:
        raise bad_request(
            f"dimensions must be {size} (this model's embedding size), got {req.dimensions}: "
            "the model is not trained for shorter (Matryoshka) embeddings", "dimensions")
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if texts in ([], [""]):
        return {"model": req.model, "embeddings": [], "total_duration": 0,
                "load_duration": 0, "prompt_eval_count": 0}
    vectors, num_tokens, load_s = await _embed(ctx, raw, texts, req.truncate,
                                               single=isinstance(req.input, str))
    return {"model": req.model, "embeddings": vectors,
            "total_duration": _ns(time.monotonic() - started),
            "load_duration": _ns(load_s - started), "prompt_eval_count": num_tokens}


async def create_embeddings(ctx: ServerContext, req: OllamaEmbeddingsRequest,
                            raw: Request) -> dict[str, Any]:
    check_model(ctx, req.model)
    parse_keep_alive(req.keep_alive)
    if not req.prompt:
        return {"embedding": []}
    vectors, _, _ = await _embed(ctx, raw, [req.prompt], truncate=True, single=True,
                                 field="prompt")
    return {"embedding": vectors[0]}


async def _embed(ctx: ServerContext, raw: Request, texts: list[str], truncate: bool,
                 single: bool, field: str = "input") -> tuple[list[list[float]], int, float]:
    """The vectors, the tokens embedded, and when the engine got the inputs."""
    check_batch(ctx, len(texts), field)
    for i, text in enumerate(texts):
        if not text:
            raise bad_request(f"{field}[{i}] is an empty string; every input needs text",
                              f"{field}.{i}")
    inputs = tokenize(ctx, texts)
    for i, ids in enumerate(inputs):
        param = field if single else f"{field}.{i}"
        if truncate:
            del ids[ctx.max_model_len:]
        check_length(ctx, ids, param, f"{field}[{i}] (truncate is false)")
    sent = time.monotonic()
    outputs = await until_disconnect(raw, pool_all(ctx, f"embed-{uuid.uuid4().hex}", inputs,
                                                   PoolingParams()))
    return ([out.outputs.data.tolist() for out in outputs], sum(len(ids) for ids in inputs),
            sent)


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))

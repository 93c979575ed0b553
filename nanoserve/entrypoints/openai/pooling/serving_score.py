"""POST /v1/rerank (also /rerank) and POST /score: how well each document answers a query.

Both reduce to scoring (query, document) pairs, by one of two methods (`--score-method`):

- "yes_no", Qwen3-Reranker's: the pair is written into a judging prompt (a system message
  asking for "yes" or "no", then `<Instruct>`, `<Query>`, `<Document>`) through the model's
  chat template, prefilled, and scored sigmoid(logit("yes") - logit("no")) at the last position,
  the probability of "yes" between the two. The query comes before the document, so a rerank's
  documents share the prompt's head in the prefix cache.
- "cosine": the query's and the document's embeddings (as /v1/embeddings makes them), dotted.

Rerank answers the documents best first (cut to `top_n`); /score answers in input order.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from nanoserve.entrypoints.openai.pooling.protocol import RerankRequest, ScoreRequest
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

SCORE_METHODS = ("yes_no", "cosine")
JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the '
                'Instruct provided. Note that the answer can only be "yes" or "no".')
JUDGE_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


async def create_rerank(ctx: ServerContext, req: RerankRequest, raw: Request,
                        method: str) -> JSONResponse:
    ctx.check_model(req.model)
    if not req.query:
        raise bad_request("query must not be empty", "query")
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    check_batch(ctx, len(documents), "documents")
    for i, text in enumerate(documents):
        if not text:
            raise bad_request(f"documents[{i}] is empty; every document needs text",
                              f"documents.{i}")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request(f"top_n must be >= 1 (omit it for every document), got {req.top_n}",
                          "top_n")
    request_id = f"rerank-{uuid.uuid4().hex}"
    scores, num_tokens = await until_disconnect(raw, score_pairs(
        ctx, request_id, method, [req.query] * len(documents), documents,
        ("query", "documents")))
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: req.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return JSONResponse({"id": request_id, "model": ctx.model_name, "results": results,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def create_score(ctx: ServerContext, req: ScoreRequest, raw: Request,
                       method: str) -> JSONResponse:
    ctx.check_model(req.model)
    firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    check_batch(ctx, len(firsts), "text_1")
    check_batch(ctx, len(seconds), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise bad_request(f"text_1 and text_2 must be lists of the same length (pairs), or "
                          f"text_1 one text; got {len(firsts)} and {len(seconds)}", "text_2")
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        for i, text in enumerate(texts):
            if not text:
                raise bad_request(f"{name}[{i}] is empty; every text needs content",
                                  f"{name}.{i}")
    request_id = f"score-{uuid.uuid4().hex}"
    scores, num_tokens = await until_disconnect(raw, score_pairs(
        ctx, request_id, method, firsts, seconds, ("text_1", "text_2")))
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": ctx.model_name,
        "data": [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def score_pairs(ctx: ServerContext, request_id: str, method: str, queries: list[str],
                      documents: list[str], fields: tuple[str, str]) -> tuple[list[float], int]:
    """Each (query, document) pair's score, and the prompt tokens it took. `fields` names the
    request's query and document fields, for errors."""
    if method == "cosine":
        return await _cosine_scores(ctx, request_id, queries, documents, fields)
    yes, no = judge_token_ids(ctx.tokenizer)
    prompts = tokenize_judge_prompts(ctx, queries, documents)
    for i, ids in enumerate(prompts):
        check_length(ctx, ids, f"{fields[1]}.{i}", f"{fields[1]}[{i}] in its judging prompt")
    outs = await pool_all(ctx, request_id, prompts,
                          PoolingParams(task="score", logit_token_ids=[yes, no]))
    # P("yes") between the two answers: softmax over [yes, no], Qwen3-Reranker's score
    scores = [1.0 / (1.0 + math.exp(float(o.outputs.data[1] - o.outputs.data[0])))
              for o in outs]
    return scores, sum(len(ids) for ids in prompts)


async def _cosine_scores(ctx: ServerContext, request_id: str, queries: list[str],
                         documents: list[str], fields: tuple[str, str]
                         ) -> tuple[list[float], int]:
    """Cosines of the texts' embeddings; each distinct text is embedded once."""
    texts = list(dict.fromkeys([*queries, *documents]))
    ids = tokenize(ctx, texts)
    ids_of = dict(zip(texts, ids, strict=True))
    for name, group in zip(fields, (queries, documents), strict=True):
        for i, text in enumerate(group):
            one = name == "query"  # a rerank's one query, repeated per document
            check_length(ctx, ids_of[text], name if one else f"{name}.{i}",
                         name if one else f"{name}[{i}]")
    outs = await pool_all(ctx, request_id, ids, PoolingParams())
    vectors = {text: out.outputs.data for text, out in zip(texts, outs, strict=True)}
    scores = [float(np.dot(vectors[q], vectors[d]))
              for q, d in zip(queries, documents, strict=True)]
    return scores, sum(len(i) for i in ids)


def judge_prompt(tokenizer: Any, chat_template: str | None, query: str, document: str) -> str:
    """The judging prompt of one pair, through the model's chat template (or --chat-template;
    Qwen3's with its thinking switched off, as Qwen3-Reranker writes an empty reasoning
    section)."""
    messages = [{"role": "system", "content": JUDGE_SYSTEM},
                {"role": "user", "content": f"<Instruct>: {JUDGE_INSTRUCTION}\n"
                                            f"<Query>: {query}\n<Document>: {document}"}]
    kwargs: dict[str, Any] = {"enable_thinking": False}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return str(tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **kwargs))


def tokenize_judge_prompts(ctx: ServerContext, queries: list[str],
                           documents: list[str]) -> list[list[int]]:
    texts = [judge_prompt(ctx.tokenizer, ctx.chat_template, q, d)
             for q, d in zip(queries, documents, strict=True)]
    # the template wrote any special tokens it wants
    return [list(ids) for ids in ctx.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def judge_token_ids(tokenizer: Any) -> tuple[int, int]:
    """The first token of "yes" and of "no", the two answers the judging prompt allows."""
    yes = tokenizer.encode("yes", add_special_tokens=False)
    no = tokenizer.encode("no", add_special_tokens=False)
    return int(yes[0]), int(no[0])

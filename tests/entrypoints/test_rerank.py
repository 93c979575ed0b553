"""POST /v1/rerank (/rerank, /v2/rerank) and POST /score through the real server: the order
(best first) and `top_n`, `return_documents`, /score's shapes, each score checked against an
independent path, and every bad field a 400 that names it.

The default method (cosine) runs on the default model, checked against the dot products of
/v1/embeddings' vectors, with the answer ranked first. The yes_no method runs on a tiny random
model: its score, P("yes") between "yes" and "no" after the judging prompt, is checked against
/v1/completions' processed logprobs of the same prompt with only those two tokens allowed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from server_harness import RunningServer
from shared_server import shared_server

from nanoserve.entrypoints.openai.pooling.serving_score import (
    judge_prompt,
    judge_token_ids,
)

QUERY = "Who wrote Romeo and Juliet?"
DOCUMENTS = ["Juliet is a common name for girls.",
             "Romeo and Juliet is a tragedy written by William Shakespeare.",
             "The printing press was invented by Gutenberg.", "Tomatoes are technically fruits."]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    # the default model, the default --score-method: test_embeddings.py's server
    return shared_server(request)


@pytest.fixture(scope="module")
def yes_no_server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    running = RunningServer(str(tiny_model_dir("llama")), "--score-method", "yes_no")
    yield running
    assert running.stop() == 0


def rerank(server: RunningServer, path: str = "/v1/rerank", **body: Any) -> dict[str, Any]:
    response = server.post(path, {"query": QUERY, "documents": DOCUMENTS, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_rerank_puts_the_answer_first_and_cuts_to_top_n(server: RunningServer) -> None:
    full = rerank(server)
    results = full["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    assert results[0]["index"] == 1  # the answer, by cosine on the default model
    assert all(r["document"]["text"] == DOCUMENTS[r["index"]] for r in results)
    assert full["model"] == "SmolLM2-135M-Instruct" and full["usage"]["prompt_tokens"] > 0
    top = rerank(server, top_n=2, return_documents=False)["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top)
    assert [r["relevance_score"] for r in top] == pytest.approx(scores[:2], abs=1e-4)
    for path in ("/rerank", "/v2/rerank"):  # Jina's and Cohere's paths: the same answer
        other = rerank(server, path, documents=[{"text": d} for d in DOCUMENTS])["results"]
        assert [r["index"] for r in other] == [r["index"] for r in results]


def test_yes_no_score_is_p_yes_between_yes_and_no(yes_no_server: RunningServer,
                                                  default_tokenizer: Any) -> None:
    server = yes_no_server
    scores = server.post("/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in scores["data"]] == [0, 1, 2, 3]
    by_rerank = {r["index"]: r["relevance_score"] for r in rerank(server)["results"]}
    assert [d["score"] for d in scores["data"]] == pytest.approx(
        [by_rerank[i] for i in range(4)], abs=1e-4)
    # the same probability from generation: the judging prompt, only "yes" and "no" allowed,
    # logprobs after that mask (processed), at temperature 1
    yes, no = judge_token_ids(default_tokenizer)
    prompt = default_tokenizer.encode(judge_prompt(default_tokenizer, None, QUERY, DOCUMENTS[1]),
                                      add_special_tokens=False)
    out = server.post("/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
        "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": 2,
        "allowed_token_ids": [yes, no], "logprobs_mode": "processed"}).json()
    top = out["choices"][0]["logprobs"]["top_logprobs"][0]
    assert math.exp(top["yes"]) == pytest.approx(scores["data"][1]["score"], abs=1e-4)
    pairs = server.post("/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [d["score"] for d in scores["data"][:2]], abs=1e-4)


@pytest.mark.slow
def test_cosine_scores_are_the_embeddings_dot_products(server: RunningServer) -> None:
    vectors = np.array([d["embedding"] for d in server.post(
        "/v1/embeddings", {"input": [QUERY, *DOCUMENTS]}).json()["data"]])
    expected = vectors[1:] @ vectors[0]
    results = rerank(server)["results"]
    assert [r["index"] for r in results] == np.argsort(-expected).tolist()
    assert [r["relevance_score"] for r in results] == pytest.approx(
        sorted(expected, reverse=True), abs=1e-5)
    scores = server.post("/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected.tolist(), abs=1e-5)
    assert scores["object"] == "list" and scores["data"][0]["object"] == "score"
    pairs = server.post("/score", {"text_1": [QUERY, DOCUMENTS[0]],
                                   "text_2": [DOCUMENTS[1], DOCUMENTS[0]]}).json()["data"]
    assert pairs[0]["score"] == pytest.approx(expected[1], abs=1e-5)
    assert pairs[1]["score"] == pytest.approx(1.0, abs=1e-5)  # a text against itself


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "must not be empty"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents.1", "is empty"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n", ">= 1"),
    ("/v1/rerank", {"query": QUERY, "documents": [1]}, "documents.0", "validation error"),
    ("/v1/rerank", {"documents": ["a"]}, "query", "Field required"),
    ("/v1/rerank", {"query": QUERY, "documents": ["word " * 9000]}, "documents.0",
     "maximum context length"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "same length"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
    ("/score", {"text_1": "", "text_2": "b"}, "text_1.0", "is empty"),
])
def test_bad_fields_are_400s_that_name_them(yes_no_server: RunningServer, path: str,
                                            body: dict[str, Any], param: str,
                                            says: str) -> None:
    response = yes_no_server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"], error
    # pydantic's own errors name the field and, in a union, the shape tried (input.str)
    assert error["param"] == param or (says == "validation error"
                                       and error["param"].startswith(param)), error


def test_wrong_model_is_404(yes_no_server: RunningServer) -> None:
    response = yes_no_server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                                 "model": "nope"})
    assert response.status_code == 404


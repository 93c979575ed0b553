"""POST /v1/embeddings through the real server on the default model, with the official openai
SDK: floats equal base64, vectors normalized and batch-invariant, token ids equal text, every
bad field a 400 that names it, and generation beside embeddings unchanged."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from server_harness import RunningServer
from shared_server import shared_server

from nanoserve.entrypoints.openai.pooling.serving_embedding import MAX_INPUTS, encode_vector

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HIDDEN_SIZE = 576  # its embedding size
SHORT = "The cat sat on the mat."  # under one KV block: no prefix-cache hit, the same math
TEXTS = [SHORT, "Paris is the capital of France.", "def add(a, b):\n    return a + b",
         "Photosynthesis turns light into chemical energy.", "I like green tea in the morning.",
         "The stock market fell sharply on Monday after the announcement.",
         "A short one.", "Quantum computers use qubits, which can be in superposition."]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    return shared_server(request)  # the default model, no flags: test_rerank.py's too


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client(timeout=120)


def vectors(response: openai.types.CreateEmbeddingResponse) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_base64_is_the_float32_bytes_of_the_floats() -> None:
    vector = np.random.default_rng(0).standard_normal(HIDDEN_SIZE).astype(np.float32)
    encoded = encode_vector(vector, "base64")
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.array_equal(decoded, vector)
    assert encode_vector(vector, "float") == vector.tolist()


def test_float_equals_base64_and_vectors_are_normalized(client: openai.OpenAI) -> None:
    as_floats = client.embeddings.create(input=SHORT, model=MODEL,
                                         encoding_format="float")
    by_default = client.embeddings.create(input=SHORT, model=MODEL)  # base64
    as_text = client.embeddings.create(input=SHORT, model=MODEL,
                                       encoding_format="base64")
    floats = vectors(as_floats)[0]
    assert floats.shape == (HIDDEN_SIZE,)
    assert np.array_equal(vectors(by_default)[0], floats)
    raw = as_text.data[0].embedding
    assert isinstance(raw, str)
    assert np.array_equal(np.frombuffer(base64.b64decode(raw), dtype="<f4"), floats)
    assert abs(np.linalg.norm(floats) - 1.0) < 1e-5
    assert as_floats.object == "list" and as_floats.data[0].object == "embedding"
    assert as_floats.model == MODEL
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens > 0


def test_batch_invariant_and_normalized(client: openai.OpenAI) -> None:
    alone = vectors(client.embeddings.create(input=[SHORT], model=MODEL))[0]
    batch = vectors(client.embeddings.create(input=TEXTS, model=MODEL))
    assert batch.shape == (8, HIDDEN_SIZE)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert cosine(alone, batch[0]) >= 1 - 1e-5
    # ...and the comparison can fail: other texts are elsewhere
    assert max(cosine(alone, other) for other in batch[1:]) < 1 - 1e-3


def test_token_ids_equal_text(server: RunningServer, client: openai.OpenAI) -> None:
    ids = [server.post("/tokenize", {"prompt": t}).json()["tokens"] for t in TEXTS[:3]]
    by_text = client.embeddings.create(input=TEXTS[:3], model=MODEL)
    by_ids = client.embeddings.create(input=ids, model=MODEL)
    one = client.embeddings.create(input=ids[1], model=MODEL)  # one id list
    for a, b in zip(vectors(by_text), vectors(by_ids), strict=True):
        assert cosine(a, b) >= 1 - 1e-5
    assert cosine(vectors(one)[0], vectors(by_text)[1]) >= 1 - 1e-5
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_dimensions_only_as_the_models_size(client: openai.OpenAI) -> None:
    full = client.embeddings.create(input=SHORT, model=MODEL,
                                    dimensions=HIDDEN_SIZE)
    assert len(full.data[0].embedding) == HIDDEN_SIZE
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(input=SHORT, model=MODEL, dimensions=64)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    assert "must be 576" in e.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["ok", ""]}, "input.1", "input[1] is an empty string"),
    ({"input": ""}, "input", "empty string"),
    ({"input": [[5, 6], []]}, "input.1", "empty list of token ids"),
    ({"input": [5, 49152]}, "input", "token id 49152, outside the vocabulary"),
    ({"input": [[5], [1] * 8193]}, "input.1", "8193 tokens, but this model's maximum"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS} items"),
    ({"input": [1, "a"]}, "input", "validation error"),
    ({"input": {"text": "a"}}, "input", "validation error"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "validation error"),
    ({"input": "a", "dimensions": 0}, "dimensions", "must be 576"),
    ({}, "input", "Field required"),
])
def test_bad_fields_are_400s_that_name_them(server: RunningServer, body: dict[str, object],
                                            param: str, says: str) -> None:
    response = server.post("/v1/embeddings", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"], error
    # pydantic's own errors name the field and, in a union, the shape tried (input.str)
    assert error["param"] == param or (says == "validation error"
                                       and error["param"].startswith(param)), error


def test_wrong_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(input=SHORT, model="no-such-model")


def test_generation_beside_embeddings_is_unchanged(client: openai.OpenAI) -> None:
    def complete() -> str:
        out = client.completions.create(model=MODEL, prompt="Once upon a time",
                                        max_tokens=16, temperature=0)
        return out.choices[0].text

    alone = complete()
    with ThreadPoolExecutor(2) as pool:
        embeds = pool.submit(client.embeddings.create, input=TEXTS * 2, model=MODEL)
        beside = pool.submit(complete)
        assert beside.result() == alone
        assert len(embeds.result().data) == 16


def test_embeddings_are_counted_in_the_metrics(server: RunningServer,
                                               client: openai.OpenAI) -> None:
    """Each input is a request to /metrics, as vLLM counts pooling requests: a success, its
    prompt tokens and its latency."""
    before = {name: server.metric(name) for name in (
        "nanoserve:request_success_total", "nanoserve:prompt_tokens_total",
        "nanoserve:e2e_request_latency_seconds_count")}
    out = client.embeddings.create(model=MODEL, input=["one metric", "two metrics"])
    assert server.metric("nanoserve:request_success_total") == \
        before["nanoserve:request_success_total"] + 2
    assert server.metric("nanoserve:prompt_tokens_total") == \
        before["nanoserve:prompt_tokens_total"] + out.usage.prompt_tokens
    assert server.metric("nanoserve:e2e_request_latency_seconds_count") == \
        before["nanoserve:e2e_request_latency_seconds_count"] + 2

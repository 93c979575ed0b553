"""/openapi.json, built in-process: every route states its request and response models and the
errors it answers in OpenAI's shape (no FastAPI 422), and each numeric range documented on a
request field is the range SamplingParams enforces (the two live apart: protocol.py documents,
SamplingParams checks with the messages clients see)."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest

from nanoserve.entrypoints.app import build_app
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.sampling_params import SamplingParams
from nanoserve.server_config import ServerConfig

# request fields under another name in SamplingParams
SAMPLING_NAME = {"top_logprobs": "logprobs", "max_completion_tokens": "max_tokens"}
# documented bounds SamplingParams does not own: completions' max_tokens may be 0 with echo
# (serving_completion.py turns it into a prompt-only request)
NOT_SAMPLING = {("CompletionRequest", "max_tokens")}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    # the handlers are never called here: the document needs the routes, not an engine (the
    # web page's routes, which read the context at once, are kept out of the document anyway)
    app = build_app(cast(Any, None), ServerConfig(web_ui=False))
    return app.openapi()


def test_every_route_documents_its_models_and_errors(schema: dict[str, Any]) -> None:
    ref = "#/components/schemas/"
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            assert "200" in responses, (method, path)
            for status, response in responses.items():
                if status.startswith("4") or status.startswith("5"):
                    content = response.get("content", {})
                    if path != "/health":  # Anthropic's and Ollama's answer in their shapes
                        error = "AnthropicErrorResponse" if path.startswith("/v1/messages") \
                            else "OllamaErrorResponse" if path.startswith("/api/") \
                            else "ErrorResponse"
                        assert content["application/json"]["schema"]["$ref"] == \
                            ref + error, (method, path, status)
            ok = responses["200"].get("content", {})
            if method == "post":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].startswith(ref), (method, path)
                assert ok["application/json"]["schema"]["$ref"].startswith(ref)
                assert {"400", "401", "413"} <= set(responses), (method, path)
            elif path not in ("/health", "/metrics"):
                assert ok["application/json"]["schema"]["$ref"].startswith(ref)
    generating = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
    for path in generating:
        operation = schema["paths"][path]["post"]
        assert "text/event-stream" in operation["responses"]["200"]["content"]
        assert {"404", "408", "429", "503"} <= set(operation["responses"])
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_a_message_role_is_one_of_openais(schema: dict[str, Any]) -> None:
    role = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert role["enum"] == ["system", "developer", "user", "assistant", "tool", "function"]


def documented_bounds() -> list[tuple[str, str, str, float]]:
    """(model, field, keyword, bound) for every numeric bound on a sampling request field."""
    out = []
    for model in (CompletionRequest, ChatCompletionRequest):
        for name, prop in model.model_json_schema()["properties"].items():
            for keyword in ("minimum", "maximum", "exclusiveMinimum"):
                if keyword in prop and (model.__name__, name) not in NOT_SAMPLING:
                    out.append((model.__name__, name, keyword, prop[keyword]))
    return out


def accepts(field: str, value: float) -> bool:
    base: dict[str, Any] = {"max_tokens": None}  # min_tokens' own bound, not max_tokens'
    try:
        SamplingParams(**{**base, field: value})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("model", "name", "keyword", "bound"), documented_bounds(),
                         ids=lambda value: str(value))
def test_documented_ranges_are_the_enforced_ones(model: str, name: str, keyword: str,
                                                 bound: float) -> None:
    field = SAMPLING_NAME.get(name, name)
    is_int = isinstance(bound, int)
    if keyword == "exclusiveMinimum":
        inside, outside = math.nextafter(bound, math.inf), bound
    elif keyword == "minimum":
        inside, outside = bound, (bound - 1 if is_int else math.nextafter(bound, -math.inf))
    else:
        inside, outside = bound, (bound + 1 if is_int else math.nextafter(bound, math.inf))
    assert accepts(field, inside), f"{model}.{name} = {inside} is documented as allowed"
    assert not accepts(field, outside), f"{model}.{name} = {outside} is documented as refused"


def test_the_ranges_cover_the_sampling_fields() -> None:
    names = {name for _, name, _, _ in documented_bounds()}
    assert {"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "logprobs",
            "top_logprobs", "prompt_logprobs", "max_tokens"} <= names

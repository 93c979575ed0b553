"""Hostile shapes get OpenAI's error object with a 4xx, never `{"detail": ...}` nor a 500: an
unknown message role, bodies the HTTP layer cannot parse (invalid JSON, 100000 nested arrays,
not an object), numbers the engine's tensors cannot hold, unknown routes and wrong methods."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from limited_server import MODEL, LimitedServer, error_of, shared_limited_server
from server_harness import RunningServer


@pytest.fixture(scope="module")
def limited_server(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LimitedServer:
    return shared_limited_server(request, tiny_model_dir("llama"))


ROLES = "'system', 'developer', 'user', 'assistant', 'tool' or 'function'"


def post_raw(server: RunningServer, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_an_unknown_role_names_the_message_and_the_roles(limited_server: LimitedServer,
                                                          path: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    error = error_of(limited_server.post(path, {"model": MODEL, "messages": messages}), 400)
    assert error["param"] == "messages.1.role"
    assert ROLES in error["message"] and "got 'wizard'" in error["message"], error


@pytest.mark.parametrize(("content", "fragment"), [
    (b'{"prompt": "hi",', "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a":' * 40_000 + b"1" + b"}" * 40_000, "nested too deeply"),
    (b"[1, 2]", "Input should be a valid dictionary"),
    (b'"a string"', "Input should be a valid dictionary"),
    (b"null", "validation error"),
    (b"", "validation error"),
])
def test_unparsable_bodies_are_400(limited_server: LimitedServer, content: bytes,
                                   fragment: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        error = error_of(post_raw(limited_server, path, content), 400)
        assert fragment in error["message"], (path, error)
    assert httpx.get(limited_server.url + "/health").status_code == 200


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "1e308"), ("temperature", "Infinity"), ("temperature", "NaN"),
    ("repetition_penalty", "1e308"), ("top_k", "1e20"), ("min_tokens", "1e20"),
    ("seed", "1e30"),
])
def test_numbers_past_the_engines_tensors_are_400(limited_server: LimitedServer, field: str,
                                                  value: str) -> None:
    """JSON carries 1e308 (and Python's parser NaN and Infinity); the sampler's per-slot
    tensors are float32 and int64: such a value once stopped the engine for everyone."""
    content = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}'
    error = error_of(post_raw(limited_server, "/v1/completions", content.encode()), 400)
    assert error["param"] == field, error
    follow = limited_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert follow.status_code == 200


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_an_unknown_route_is_404(limited_server: LimitedServer, method: str) -> None:
    response = httpx.request(method, limited_server.url + "/v1/nope", json={})
    error = error_of(response, 404)
    assert error["message"] == f"no route {method} /v1/nope"


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"),
    ("POST", "/v1/models", "GET"), ("DELETE", "/health", "GET"),
])
def test_a_wrong_method_is_405(limited_server: LimitedServer, method: str, path: str,
                               allowed: str) -> None:
    response = httpx.request(method, limited_server.url + path)
    error = error_of(response, 405)
    assert response.headers["allow"] == allowed
    assert error["message"] == f"method {method} is not allowed on {path}; allowed: {allowed}"

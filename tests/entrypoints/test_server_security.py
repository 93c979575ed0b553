"""Security settings, each off by default: CORS only for `--allowed-origins`, prompt text in the
logs only with `--log-requests`, and with `--api-key` every route but /health guarded (the
routes taken from the served OpenAPI document, so a new route is covered by itself)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from limited_server import MODEL, LimitedServer, shared_limited_server
from server_harness import API_KEY, RunningServer


@pytest.fixture(scope="module")
def limited_server(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LimitedServer:
    return shared_limited_server(request, tiny_model_dir("llama"))


GOOD_ORIGIN = "http://good.example"
EVIL_ORIGIN = "http://evil.example"


@pytest.fixture(scope="module")
def open_server(tiny_model_dir: Any,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """CORS for one origin, the API key, and prompts in the logs."""
    log_path = tmp_path_factory.mktemp("open-server") / "server.log"
    server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", MODEL,
                          "--allowed-origins", GOOD_ORIGIN, "--log-requests", "--log-level",
                          "info", api_key=API_KEY, log=log_path)
    yield server
    assert server.stop() == 0


def send_secrets(server: RunningServer, secret: str) -> None:
    chat = server.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": secret}]})
    completion = server.post("/v1/completions", {"model": MODEL, "max_tokens": 2,
                                                 "prompt": secret, "stop": [secret[:6]]})
    assert chat.status_code == completion.status_code == 200


def test_no_cors_headers_by_default(limited_server: LimitedServer) -> None:
    response = httpx.get(limited_server.url + "/v1/models", headers={"Origin": GOOD_ORIGIN})
    assert response.status_code == 200
    assert not any(name.startswith("access-control-") for name in response.headers)
    preflight = httpx.options(limited_server.url + "/v1/chat/completions", headers={
        "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code == 405


def test_cors_for_the_allowed_origin_only(open_server: RunningServer) -> None:
    allowed = httpx.get(open_server.url + "/v1/models", headers={
        "Origin": GOOD_ORIGIN, **open_server.headers})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    other = httpx.get(open_server.url + "/v1/models", headers={
        "Origin": EVIL_ORIGIN, **open_server.headers})
    assert "access-control-allow-origin" not in other.headers
    # a browser's preflight carries no key: answered before the key is asked for
    preflight = httpx.options(open_server.url + "/v1/chat/completions", headers={
        "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = httpx.options(open_server.url + "/v1/chat/completions", headers={
        "Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # the page can read a 401 too (the header is on errors as well)
    unauthorized = httpx.get(open_server.url + "/v1/models", headers={"Origin": GOOD_ORIGIN})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == GOOD_ORIGIN


def test_logs_hold_no_prompt_text_by_default(limited_server: LimitedServer) -> None:
    secret = "zebra-secret-4711"
    send_secrets(limited_server, secret)
    log = limited_server.log_path.read_text()
    assert "request chatcmpl-" in log and "request cmpl-" in log, log[-2000:]
    assert "prompt tokens" in log
    assert secret not in log and "zebra" not in log


def test_logs_hold_prompts_with_log_requests(open_server: RunningServer) -> None:
    secret = "okapi-secret-0815"
    send_secrets(open_server, secret)
    log = open_server.log_path.read_text()
    assert log.count(secret) >= 2, log[-2000:]  # the chat's and the completion's prompt


def test_api_key_on_every_route_but_health(open_server: RunningServer) -> None:
    schema = httpx.get(open_server.url + "/openapi.json", headers=open_server.headers).json()
    routes = [(method.upper(), path) for path, operations in schema["paths"].items()
              for method in operations] + [("GET", "/openapi.json"), ("GET", "/v1/unknown")]
    assert len(routes) >= 10
    for method, path in routes:
        if path == "/health":
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, open_server.url + path, headers=headers,
                                     json={} if method == "POST" else None)
            assert response.status_code == 401, (method, path, headers)
            # (Anthropic's routes answer in Anthropic's shape, Ollama's in Ollama's)
            error = response.json()["error"]
            if path.startswith("/api/"):
                assert isinstance(error, str) and "API key" in error, (path, error)
            else:
                assert error["type"] == ("authentication_error"
                                         if path.startswith("/v1/messages")
                                         else "AuthenticationError")
        with_key = httpx.request(method, open_server.url + path, headers=open_server.headers,
                                 json={} if method == "POST" else None, timeout=60)
        assert with_key.status_code != 401, (method, path)
    assert httpx.get(open_server.url + "/health").status_code == 200

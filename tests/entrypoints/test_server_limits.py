"""Limits that protect the server (`nanoserve serve` flags; conftest.py's LIMITS): each a 4xx
in OpenAI's error shape naming the field, the value and the limit; the value at the limit is
accepted. And the per-request deadline: aborted in the engine, its blocks freed, the client
answered 408 (or, in a stream, an error event and then [DONE])."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from limited_server import MODEL, LimitedServer, error_of, shared_limited_server
from server_harness import RunningServer, sse_events


@pytest.fixture(scope="module")
def limited_server(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LimitedServer:
    return shared_limited_server(request, tiny_model_dir("llama"))


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "param", "fragment"), [
    ("/v1/completions", {"n": 5}, "n", "n must be at most 4 (--max-n), got 5"),
    ("/v1/chat/completions", {"n": 5}, "n", "n must be at most 4 (--max-n), got 5"),
    ("/v1/completions", {"n": 1000000}, "n", "got 1000000"),
    ("/v1/completions", {"stop": ["a", "b", "c"]}, "stop",
     "stop must be at most 2 strings (--max-stop-strings), got 3"),
    ("/v1/chat/completions", {"stop": "123456789"}, "stop",
     "at most 8 characters (--max-stop-string-length), got one of 9"),
    ("/v1/completions", {"bad_words": ["a", "b", "c"]}, "bad_words",
     "bad_words must be at most 2 words (--max-bad-words), got 3"),
    ("/v1/chat/completions", {"bad_words": ["123456789"]}, "bad_words",
     "each bad word must be at most 8 characters (--max-stop-string-length), got one of 9"),
    ("/v1/completions", {"logprobs": 6}, "logprobs",
     "logprobs must be <= 5 (--max-logprobs), got 6"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs",
     "top_logprobs must be <= 5 (--max-logprobs), got 6"),
    ("/v1/completions", {"prompt_logprobs": 6}, "prompt_logprobs",
     "prompt_logprobs must be <= 5"),
    ("/v1/completions", {"max_tokens": 256}, "max_tokens",
     "'max_tokens' or 'max_completion_tokens' is too large: 256. This model's maximum context "
     "length is 256 tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 10000}, "max_tokens",
     "is too large: 10000"),
    ("/v1/completions", {"prompt": "hello " * 300}, "input_tokens",
     "maximum context length is 256 tokens. However, your request has"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 300}]},
     "input_tokens", "maximum context length is 256 tokens"),
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt",
     "prompt must be a batch of at most 8 prompts (--max-in-flight), got 9"),
    ("/v1/completions", {"prompt": ["a"] * 3, "n": 3}, "n",
     "n times the prompts must be at most 8 sequences (--max-in-flight), got 3 x 3"),
])
def test_past_each_limit_is_a_400_naming_it(limited_server: LimitedServer, path: str,
                                            body: dict[str, Any], param: str,
                                            fragment: str) -> None:
    is_chat = path.endswith("chat/completions")
    base = {"model": MODEL, "max_tokens": 4,
            **({"messages": CHAT} if is_chat else {"prompt": "hi"})}
    error = error_of(limited_server.post(path, {**base, **body}), 400)
    assert error["param"] == param and fragment in error["message"], error
    assert error["type"] == "BadRequestError"


def test_at_each_limit_is_accepted(limited_server: LimitedServer) -> None:
    client = limited_server.client()
    done = client.completions.create(model=MODEL, prompt=["a"] * 2, n=4, max_tokens=2,
                                     logprobs=5, stop=["12345678", "x"], temperature=1.0,
                                     extra_body={"bad_words": ["12345678", "y"]})
    assert len(done.choices) == 2 * 4
    batch = client.completions.create(model=MODEL, prompt=["a"] * 8, max_tokens=1)
    assert len(batch.choices) == 8
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=4, logprobs=True,
                                          top_logprobs=5, max_completion_tokens=2)
    assert len(chat.choices) == 4 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 5


def test_the_sdk_sees_a_bad_request(limited_server: LimitedServer) -> None:
    with pytest.raises(openai.BadRequestError, match=r"--max-n") as raised:
        limited_server.client().chat.completions.create(model=MODEL, messages=CHAT, n=100)
    assert raised.value.param == "n"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_past_the_limit_is_413(limited_server: LimitedServer, path: str) -> None:
    body = {"model": MODEL, "prompt": "x" * 270000, "messages": CHAT}
    error = error_of(limited_server.post(path, body), 413)
    assert "at most 262144 bytes (--max-request-body-bytes), got 270" in error["message"]
    assert error["type"] == "PayloadTooLargeError"


def test_a_chunked_body_past_the_limit_is_413(limited_server: LimitedServer) -> None:
    """No Content-Length to refuse up front: counted as it arrives."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(70):
            yield b"x" * 4096
        yield b'"}'

    response = httpx.post(limited_server.url + "/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=30)
    error = error_of(response, 413)
    assert "at most 262144 bytes" in error["message"]
    ok = httpx.post(limited_server.url + "/v1/completions", json={"prompt": "x" * 250000,
                                                                  "max_tokens": 1}, timeout=30)
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "input_tokens"


@pytest.fixture(scope="module")
def deadline_server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    server = RunningServer(str(tiny_model_dir("llama")), "--request-timeout", "0.5",
                           "--served-model-name", MODEL)
    yield server
    assert server.stop() == 0


# thousands of decode steps for 64 sequences: far past a 0.5 s deadline on any machine
LONG = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "n": 64, "temperature": 1.0}


def test_the_deadline_aborts_and_frees(deadline_server: RunningServer) -> None:
    idle_usage = deadline_server.metric("nanoserve:kv_cache_usage_perc")
    error = error_of(deadline_server.post("/v1/completions", LONG), 408)
    assert "deadline of 0.5 s (--request-timeout)" in error["message"]
    assert error["type"] == "TimeoutError"
    with httpx.stream("POST", deadline_server.url + "/v1/completions",
                      json={**LONG, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 408
    assert all("error" not in json.loads(e) for e in events[:-2])
    wait_for(lambda: deadline_server.metric("nanoserve:num_requests_running") == 0
             and deadline_server.metric("nanoserve:kv_cache_usage_perc") == idle_usage)
    short = deadline_server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert short.choices[0].finish_reason == "length"


def test_the_deadline_reaches_the_sdk(deadline_server: RunningServer) -> None:
    with pytest.raises(openai.APIStatusError, match="--request-timeout") as raised:
        deadline_server.client().chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=900, n=64, temperature=1.0,
            extra_body={"ignore_eos": True})
    assert raised.value.status_code == 408


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    """Poll until `condition()` holds; the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)

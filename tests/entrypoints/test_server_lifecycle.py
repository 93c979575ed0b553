"""Server lifecycle on tiny models: engine death, SIGTERM drain, overload, several API
processes, and the reasoning split."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import RunningServer, sse_events


def engine_pid(server: RunningServer) -> int:
    """The engine core: the launcher's spawned child (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text()
    for pid in children.split():
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError("engine process not found")


def test_killing_the_engine_fails_requests_and_stops_the_server(tiny_model_dir: Any) -> None:
    server = RunningServer(str(tiny_model_dir("llama")))
    errors: list[str] = []

    def long_stream() -> None:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 8,
                "temperature": 1.0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=30) as response:
            errors.extend(e for e in sse_events(response) if '"error"' in e)

    thread = threading.Thread(target=long_stream)
    thread.start()
    time.sleep(1.0)
    started = time.monotonic()
    os.kill(engine_pid(server), signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive(), "the in-flight stream hung"
    assert errors and json.loads(errors[0])["error"]["code"] == 503
    assert time.monotonic() - started < 5
    health = None
    with contextlib.suppress(httpx.HTTPError):  # (it may have exited already)
        health = httpx.get(server.url + "/health", timeout=2).status_code
    assert health in (503, None)
    assert server.proc.wait(timeout=15) != 0


def test_sigterm_drains_in_flight_requests(tiny_model_dir: Any) -> None:
    server = RunningServer(str(tiny_model_dir("llama")), "--shutdown-timeout", "120")
    results: list[Any] = []

    def request() -> None:
        try:
            response = httpx.post(server.url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 600, "ignore_eos": True, "n": 4,
                "temperature": 1.0}, timeout=180)
            results.append(response.json())
        except Exception as e:  # reported by the assertion below
            results.append(e)

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert httpx.get(server.url + "/health", timeout=2).status_code == 503
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "y"}, timeout=5)
    assert refused.status_code == 503
    thread.join(timeout=180)
    assert results and isinstance(results[0], dict), results
    assert [c["finish_reason"] for c in results[0]["choices"]] == ["length"] * 4
    assert results[0]["usage"]["completion_tokens"] == 2400
    assert server.proc.wait(timeout=60) == 0


def test_overload_is_429(tiny_model_dir: Any) -> None:
    server = RunningServer(str(tiny_model_dir("llama")), "--max-in-flight", "1")
    try:
        # 8 samples drawn over the whole vocabulary: long enough to still be in flight
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 8,
                "temperature": 1.0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=30) as response:
            lines = response.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)
            second = httpx.post(server.url + "/v1/completions", json={"prompt": "y"}, timeout=5)
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "RateLimitError"
    finally:
        server.stop()


def test_two_api_servers_serve_the_same_results(tiny_model_dir: Any) -> None:
    model = str(tiny_model_dir("qwen2"))
    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]

    def answers(server: RunningServer) -> list[str]:
        client = server.client()
        out = []
        for prompt in prompts * 2:  # several connections, spread over the processes
            out.append(client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                 temperature=0.8, seed=9).choices[0].text)
        return out

    one = RunningServer(model)
    try:
        expected = answers(one)
    finally:
        one.stop()
    two = RunningServer(model, "--api-server-count", "2")
    try:
        assert answers(two) == expected
    finally:
        assert two.stop() == 0


def test_reasoning_split_on_a_qwen3_style_model(tiny_reasoning_model_dir: Path) -> None:
    model = str(tiny_reasoning_model_dir)
    server = RunningServer(model, "--reasoning-parser", "qwen3")
    try:
        client = server.client()
        kwargs: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=12, temperature=0.7, seed=2,
                                      extra_body={"thinking_token_budget": 4,
                                                  "ignore_eos": True})
        whole = client.chat.completions.create(**kwargs).choices[0].message
        extra = whole.model_extra
        assert extra["reasoning"] and extra["reasoning"] == extra["reasoning_content"]
        assert whole.content
        assert "<think>" not in whole.content and "</think>" not in extra["reasoning"]
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning") or ""
                content += delta.content or ""
        assert (reasoning, content) == (extra["reasoning"], whole.content)
        # enable_thinking=False: the template closes the section, everything is content
        off = client.chat.completions.create(**{**kwargs, "extra_body": {
            "chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}})
        assert off.choices[0].message.model_extra["reasoning"] is None
        assert off.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
            client.chat.completions.create(**{**kwargs, "extra_body": {
                "thinking_token_budget": -1}})
    finally:
        server.stop()

"""Server lifecycle on tiny models: engine death under load, the API process killed, overload,
several API processes, and the reasoning split (the ways of stopping a server, draining:
test_server_stop.py).

Every wait here is on a state (a streamed chunk, a metric, a process gone), never a fixed
sleep; every server is started through the `start_server` fixture, which stops it on teardown
whatever the test did.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import RunningServer, process_gone, wait_until

Starter = Callable[..., RunningServer]


@pytest.fixture
def start_server() -> Iterator[Starter]:
    """`start_server(model, *args)`: a running server, stopped after the test in any case."""
    started: list[RunningServer] = []

    def start(*args: str, **kwargs: Any) -> RunningServer:
        server = RunningServer(*args, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        with contextlib.suppress(Exception):
            server.stop(timeout=20)


def child_pids(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def engine_pid(server: RunningServer) -> int:
    """The engine core: the launcher's spawned child (not multiprocessing's resource tracker)."""
    for pid in child_pids(server.proc.pid):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("engine process not found")


LONG_STREAM = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True,
               "temperature": 1.0}  # drawn over the whole vocabulary: no early EOS


class Streams:
    """`count` streamed completions on threads; each records when its first chunk arrived,
    the error events it got, and when its stream ended."""

    def __init__(self, server: RunningServer, count: int) -> None:
        self.first_chunk = threading.Semaphore(0)
        self.errors: list[list[str]] = [[] for _ in range(count)]
        self.ended_at: list[float | None] = [None] * count
        self.threads = [threading.Thread(target=self._run, args=(server, i), daemon=True)
                        for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self, server: RunningServer, i: int) -> None:
        announced = False
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=LONG_STREAM,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if not announced:
                        announced = True
                        self.first_chunk.release()
                    if line.startswith("data: ") and '"error"' in line:
                        self.errors[i].append(line[len("data: "):])
        except httpx.HTTPError as e:  # the connection dropped: an error the client sees too
            self.errors[i].append(repr(e))
        finally:
            self.ended_at[i] = time.monotonic()
            if not announced:
                self.first_chunk.release()

    def wait_all_started(self, timeout: float = 60.0) -> None:
        for _ in self.threads:
            assert self.first_chunk.acquire(timeout=timeout), "a stream never started"

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def assert_all_told(self, server: RunningServer, killed_at: float, within: float) -> None:
        """After a kill at `killed_at`: every stream ended with an error within `within`
        seconds (an SSE error event says 503), /health says 503 or the server is gone, and
        the server exits non-zero."""
        self.join(timeout=10)
        assert not any(t.is_alive() for t in self.threads), "an in-flight stream hung"
        waits = [end - killed_at for end in self.ended_at if end is not None]
        assert len(waits) == len(self.threads) and max(waits) < within, \
            f"clients told after {max(waits):.2f} s"
        for errors in self.errors:
            assert errors, "a stream ended without an error"
            if errors[0].startswith("{"):  # an SSE error event, OpenAI's shape
                assert json.loads(errors[0])["error"]["code"] == 503
        health = None
        with contextlib.suppress(httpx.HTTPError):  # (it may have exited already)
            health = httpx.get(server.url + "/health", timeout=2).status_code
        assert health in (503, None)
        assert server.proc.wait(timeout=15) != 0


def test_killing_the_engine_under_32_streams_fails_every_client_fast(
        tiny_model_dir: Any, start_server: Starter) -> None:
    server = start_server(str(tiny_model_dir("llama")))
    streams = Streams(server, 32)
    streams.wait_all_started()
    assert all(not errors for errors in streams.errors), "a stream failed before the kill"
    killed_at = time.monotonic()
    os.kill(engine_pid(server), signal.SIGKILL)
    streams.assert_all_told(server, killed_at, within=2.0)


def test_killing_the_api_process_leaves_no_orphan(tiny_model_dir: Any,
                                                  start_server: Starter) -> None:
    """SIGKILL gives the launcher no chance to clean up: the engine core and the second API
    process must notice their parent is gone and exit by themselves."""
    server = start_server(str(tiny_model_dir("llama")), "--api-server-count", "2")
    children = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[-48:]
                for pid in child_pids(server.proc.pid)}  # engine, API processes, and
    assert engine_pid(server) in children and len(children) >= 3  # multiprocessing's tracker
    streams = Streams(server, 4)
    streams.wait_all_started()
    server.proc.kill()
    server.proc.wait(timeout=10)
    for pid, cmdline in children.items():
        wait_until(lambda pid=pid: process_gone(pid), f"child {pid} ({cmdline!r}) to exit",
                   timeout=15)
    streams.join(timeout=10)
    assert all(errors for errors in streams.errors), "a client was not told"


def test_overload_is_429(tiny_model_dir: Any, start_server: Starter) -> None:
    server = start_server(str(tiny_model_dir("llama")), "--max-in-flight", "8")
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


def test_two_api_servers_serve_the_same_results(tiny_model_dir: Any,
                                                start_server: Starter) -> None:
    model = str(tiny_model_dir("qwen2"))
    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]

    def answers(server: RunningServer) -> list[str]:
        client = server.client()
        out = []
        for prompt in prompts * 2:  # several connections, spread over the processes
            out.append(client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                 temperature=0.8, seed=9).choices[0].text)
        return out

    one = start_server(model, wait=False)  # both start at once, each on a core
    two = start_server(model, "--api-server-count", "2", wait=False)
    one.wait_healthy()
    two.wait_healthy()
    expected = answers(one)
    one.stop()
    assert answers(two) == expected
    assert two.stop() == 0


def test_reasoning_split_on_a_qwen3_style_model(tiny_reasoning_model_dir: Path,
                                                start_server: Starter) -> None:
    model = str(tiny_reasoning_model_dir)
    server = start_server(model, "--reasoning-parser", "qwen3")
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

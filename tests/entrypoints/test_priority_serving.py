"""`priority` on the OpenAI APIs (the official SDK's `extra_body`, as vLLM's users send it):
with `--scheduling-policy priority` a later urgent request on a full server gets its first
token before any queued low one, and every output is what it is alone; without the policy a
non-zero priority is vLLM's 400."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from limited_server import MODEL, shared_limited_server
from server_harness import RunningServer

pytestmark = pytest.mark.server

LOW = {"max_tokens": 24, "temperature": 0.7}  # each request's length and sampling


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", MODEL,
                           "--scheduling-policy", "priority", "--max-num-seqs", "2")
    yield server
    assert server.stop() == 0


def test_an_urgent_request_passes_the_queue_and_no_output_changes(
        priority_server: RunningServer) -> None:
    client = priority_server.client(timeout=120)
    first_token: dict[str, float] = {}
    texts: dict[str, str] = {}

    def stream(name: str, seed: int, priority: int) -> None:
        chunks = client.completions.create(
            model=MODEL, prompt=f"Request {name} says", stream=True, seed=seed,
            extra_body={"priority": priority, "ignore_eos": True},
            max_tokens=LOW["max_tokens"], temperature=LOW["temperature"])
        parts = []
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text and name not in first_token:
                first_token[name] = time.monotonic()
            parts.extend(c.text for c in chunk.choices)
        texts[name] = "".join(parts)

    lows = [threading.Thread(target=stream, args=(f"low{i}", i, 10)) for i in range(6)]
    for thread in lows:
        thread.start()
    deadline = time.monotonic() + 60
    while len(first_token) < 2 and time.monotonic() < deadline:  # two run; four queue
        time.sleep(0.01)
    running = set(first_token)
    assert len(running) == 2
    urgent = threading.Thread(target=stream, args=("urgent", 99, -5))
    urgent.start()
    for thread in [*lows, urgent]:
        thread.join(timeout=120)
    queued = [name for name in first_token if name.startswith("low") and name not in running]
    assert len(queued) == 4
    assert all(first_token["urgent"] < first_token[name] for name in queued)
    # each output is the one it gets alone (seeded: batch-invariant)
    for name, seed, priority in [("urgent", 99, -5), ("low3", 3, 10)]:
        alone = client.completions.create(
            model=MODEL, prompt=f"Request {name} says", seed=seed,
            extra_body={"priority": priority, "ignore_eos": True},
            max_tokens=LOW["max_tokens"], temperature=LOW["temperature"])
        assert alone.choices[0].text == texts[name], name
    metrics = httpx.get(priority_server.url + "/metrics").text
    assert 'time_to_first_token_seconds_by_priority_count{model_name="tiny",priority="-5"}' \
        in metrics


def test_without_the_policy_a_priority_is_vllms_400(request: pytest.FixtureRequest,
                                                    tiny_model_dir: Any) -> None:
    server = shared_limited_server(request, tiny_model_dir("llama"))
    client = server.client()
    for call in (lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                    extra_body={"priority": 1}),
                 lambda: client.chat.completions.create(
                     model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                     extra_body={"priority": -2})):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert "but Priority scheduling is not enabled." in str(refused.value)
        assert refused.value.body["param"] == "priority"  # type: ignore[index]
    responses = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 2, "priority": 4})
    assert responses.status_code == 400
    assert responses.json()["error"]["message"] == (
        "Got priority 4 but Priority scheduling is not enabled.")
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                      extra_body={"priority": 0})
    assert plain.choices[0].text is not None

"""llama-server's `prompt_progress` (`"return_progress": true`) from the real server on the tiny
model, with 64-token prefill chunks: read as raw server-sent events and through the official
OpenAI SDK (`extra_body`, the chunk's extra field). A long prompt reports each chunk, with
`processed` rising to `total` (usage's prompt_tokens) and `cache` equal to usage's
cached_tokens; no request that did not ask (or is not streamed) gets one."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import RunningServer, sse_events

MODEL = "tiny"
CHUNK = 64  # --max-num-batched-tokens
FIELDS = ["total", "cache", "processed", "time_ms"]  # llama-server's, in its order


@pytest.fixture(scope="module")
def server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", MODEL,
                           "--max-num-batched-tokens", str(CHUNK))
    yield server
    assert server.stop() == 0


def long_text() -> str:
    """A text of a few hundred tokens that starts with words no earlier prompt had (a cold
    prefix cache)."""
    return uuid.uuid4().hex + " " + " ".join(f"item {i} of the list," for i in range(60))


def stream(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's events, parsed (less the closing [DONE])."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def check_progress(progress: list[dict[str, Any]], usage: dict[str, Any]) -> None:
    """One object per chunk computed (the cached part is none); `processed` strictly rising
    from `cache` + a chunk to `total`; `total` and `cache` as usage counts them."""
    assert all(list(p) == FIELDS and all(isinstance(p[k], int) for k in FIELDS)
               for p in progress), progress
    total, cache = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert len(progress) == -(-(total - cache) // CHUNK), progress
    assert all(p["total"] == total and p["cache"] == cache for p in progress)
    processed = [p["processed"] for p in progress]
    assert processed == sorted(set(processed)) and processed[-1] == total
    assert processed[0] == min(cache + CHUNK, total)
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times) and times[0] >= 0


def test_completions_stream_reports_each_chunk_and_the_cached_part(
        server: RunningServer) -> None:
    prompt = long_text()
    events = stream(server, "/v1/completions", {"prompt": prompt, "return_progress": True})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    check_progress(progress, events[-1]["usage"])
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(progress) >= 4
    first_text = next(i for i, e in enumerate(events) if e["choices"] and e["choices"][0]["text"])
    shown = [e for e in events if "prompt_progress" in e]
    assert events.index(shown[-1]) < first_text  # every progress chunk before the text
    assert all(e["object"] == "text_completion" and e["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": None}] for e in shown)
    # the same prompt again: its cached blocks are `cache`, counted in `processed` at once
    again = stream(server, "/v1/completions", {"prompt": prompt, "return_progress": True})
    usage = again[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    check_progress([e["prompt_progress"] for e in again if "prompt_progress" in e], usage)


def test_chat_stream_sends_llama_servers_chunks(server: RunningServer) -> None:
    messages = [{"role": "user", "content": long_text()}]
    events = stream(server, "/v1/chat/completions",
                    {"messages": messages, "return_progress": True})
    shown = [e for e in events if "prompt_progress" in e]
    check_progress([e["prompt_progress"] for e in shown], events[-1]["usage"])
    assert len(shown) >= 4
    assert all(e["object"] == "chat.completion.chunk" and e["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None,
         "finish_reason": None}] for e in shown)
    content = [i for i, e in enumerate(events) if e["choices"]
               and e["choices"][0]["delta"].get("content")]
    assert content and events.index(shown[-1]) < content[0]


def test_none_unless_asked_and_streamed(server: RunningServer) -> None:
    for path, body in (("/v1/completions", {"prompt": long_text()}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": long_text()}]})):
        events = stream(server, path, body)
        assert events and not any("prompt_progress" in e for e in events)
        # not streamed: accepted and ignored, as llama-server does
        whole = server.post(path, {**body, "model": MODEL, "max_tokens": 4,
                                   "return_progress": True})
        assert whole.status_code == 200 and "prompt_progress" not in whole.json()


def test_openai_sdk_reads_the_extra_field(server: RunningServer) -> None:
    client = server.client()
    messages = [{"role": "user", "content": long_text()}]
    cached, counts = [], []
    for _ in range(2):  # the same prompt twice: cold (but the template's start), then cached
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_progress": True}))
        progress = [c.model_extra["prompt_progress"] for c in chunks
                    if c.model_extra and "prompt_progress" in c.model_extra]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
        check_progress(progress, usage.model_dump())
        counts.append(len(progress))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text  # the null content of the progress chunks reads as nothing
    assert cached[1] > cached[0] + CHUNK and counts[0] >= 4 and counts[1] < counts[0]
    stream = client.completions.create(model=MODEL, prompt=long_text(), max_tokens=4,
                                       stream=True, extra_body={"return_progress": True})
    assert sum("prompt_progress" in (c.model_extra or {}) for c in stream) >= 4

"""What vllm-router asks a replica, through a real `nanoserve serve` (the tiny model, shared
with test_chaos.py): the render routes give exactly the ids the endpoint prefills (equal to
/tokenize, counted the same as the completion's prompt_tokens), with the endpoints' own
errors; /get_server_info names the model, the instance and the block size; /kv_event_sources
is a 404 where no events are published (the router's "route this one by load"), and names
each engine's publisher where they are (through vllm-router: test_vllm_router.py)."""

from __future__ import annotations

from typing import Any

import pytest
from server_harness import RunningServer
from shared_server import shared_server

from nanoserve.config import KVEventsConfig
from nanoserve.entrypoints.openai.router_endpoints import kv_event_sources

MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What colour is the sky?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tiny_model_dir: Any) -> RunningServer:
    return shared_server(request, str(tiny_model_dir("llama")))


def ok(server: RunningServer, path: str, body: dict[str, Any]) -> Any:
    response = server.post(path, body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_chat_render_is_what_the_chat_endpoint_prefills(server: RunningServer,
                                                        tools: Any) -> None:
    extra = {"tools": tools} if tools else {}
    rendered = ok(server, "/v1/chat/completions/render", {"messages": MESSAGES, **extra})
    assert list(rendered) == ["token_ids"]
    ids = rendered["token_ids"]
    assert ids == ok(server, "/tokenize", {"messages": MESSAGES, **extra})["tokens"]
    done = ok(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **extra})
    assert done["usage"]["prompt_tokens"] == len(ids)
    if tools:  # the tools are in the prompt: longer than the same messages without them
        plain = ok(server, "/v1/chat/completions/render", {"messages": MESSAGES})["token_ids"]
        assert len(ids) > len(plain)


def test_completion_render_gives_each_prompts_ids(server: RunningServer) -> None:
    text, other = "The quick brown fox jumps over the lazy dog", "Hello"
    rendered = ok(server, "/v1/completions/render", {"prompt": [text, other]})
    text_ids = ok(server, "/tokenize", {"prompt": text})["tokens"]
    other_ids = ok(server, "/tokenize", {"prompt": other})["tokens"]
    assert rendered == [{"token_ids": text_ids}, {"token_ids": other_ids}]
    assert ok(server, "/v1/completions/render", {"prompt": text}) == [{"token_ids": text_ids}]
    given = [[1, 2, 3, 4, 5], [6, 7]]  # ids are prefilled as given
    assert ok(server, "/v1/completions/render", {"prompt": given}) == [
        {"token_ids": ids} for ids in given]
    done = ok(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == len(text_ids)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 100000}, 400, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**7}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "x"}, 400, "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "there"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, 400,
     None),
], ids=lambda v: str(v)[:30])
def test_render_refuses_what_the_endpoint_refuses(server: RunningServer, path: str,
                                                  body: dict[str, Any], status: int,
                                                  param: str | None) -> None:
    real = server.post(path, body)
    render = server.post(path + "/render", body)
    assert (real.status_code, render.status_code) == (status, status), render.text
    assert render.json() == real.json()  # OpenAI's error object, the same message and field
    error = render.json()["error"]
    if param is not None:
        assert error["param"] == param


def test_get_server_info_names_model_instance_and_block_size(server: RunningServer) -> None:
    info = httpx_get(server, "/get_server_info")
    model_id = httpx_get(server, "/v1/models")["data"][0]["id"]
    assert info["model_id"] == model_id
    assert info["kv_block_size"] == info["effective_attention_block_size"] == 16
    assert info["worker_type"] == "regular" and info["max_model_len"] > 0
    assert len(info["instance_id"]) == 32 and httpx_get(server, "/get_server_info") == info
    assert "tiny-llama" in info["model_path"]  # the directory served


def test_kv_event_sources_is_404_without_events(server: RunningServer) -> None:
    import httpx

    response = httpx.get(server.url + "/kv_event_sources", headers=server.headers, timeout=30)
    assert response.status_code == 404, response.text
    assert "--kv-events-config" in response.json()["error"]["message"]


def test_kv_event_sources_names_each_engines_publisher() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                            replay_endpoint="tcp://*:5558")
    sources = kv_event_sources(config, num_engines=2)
    assert list(sources) == ["0", "1"]
    assert (sources["0"]["endpoint"], sources["0"]["replay_endpoint"]) == \
        ("tcp://*:5557", "tcp://*:5558")
    # engine k publishes on the configured ports plus k, as vLLM's data-parallel ranks do
    assert (sources["1"]["endpoint"], sources["1"]["replay_endpoint"]) == \
        ("tcp://*:5558", "tcp://*:5559")
    # what vllm-router checks before it subscribes (its `events_enabled`)
    assert all((s["publisher"], s["encoding"], s["schema_version"]) == ("zmq", "msgpack", 1)
               for s in sources.values())
    assert kv_event_sources(KVEventsConfig(enable_kv_cache_events=True),
                            1)["0"]["replay_endpoint"] is None
    assert kv_event_sources(KVEventsConfig()) == {}  # events off
    assert kv_event_sources(KVEventsConfig(enable_kv_cache_events=True, publisher="null")) == {}


def httpx_get(server: RunningServer, path: str) -> Any:
    import httpx

    response = httpx.get(server.url + path, headers=server.headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()

"""The OpenAI-compatible server on the default model, driven by the official `openai` SDK and
raw HTTP: endpoints, stream shapes, logprobs, echo, stops, seeds, errors, auth, metrics,
disconnects."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_harness import API_KEY, RunningServer, sse_events, wait_until
from shared_server import shared_server

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    # test_responses_api.py's server too: the counters below are read as deltas
    return shared_server(request, "--max-model-len", "4096", api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


CHAT = [{"role": "user", "content": "Name three colors."}]


def test_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                          temperature=0)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    done = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    assert done.object == "text_completion" and "Paris" in done.choices[0].text
    assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]


def test_streams_equal_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(messages=CHAT, **kwargs).choices[0].message.content
    stream = client.chat.completions.create(messages=CHAT, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    text = client.completions.create(prompt="Once upon a time", **kwargs).choices[0].text
    stream = client.completions.create(prompt="Once upon a time", stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in stream) == text


def test_cached_tokens_count_the_prefix_cache_hits(client: openai.OpenAI) -> None:
    """usage.prompt_tokens_details.cached_tokens: little on a new prompt, whole blocks of it
    when the same prompt comes again (chat streamed with usage, and completions)."""
    story = " ".join(f"Line {i} of a story that is told again." for i in range(40))
    messages = [{"role": "user", "content": story}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0)
    # (the template's system preamble may be cached from earlier tests: a block or two)
    assert first.usage.prompt_tokens_details.cached_tokens <= 32
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    (usage,) = [chunk.usage for chunk in stream if chunk.usage]
    prompt = first.usage.prompt_tokens
    assert prompt - 16 < usage.prompt_tokens_details.cached_tokens < prompt
    again = client.completions.create(model=MODEL, prompt=story, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # not chat's templated prompt
    again = client.completions.create(model=MODEL, prompt=story, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > again.usage.prompt_tokens - 16


def test_cache_salt_keeps_cached_prompts_apart(client: openai.OpenAI) -> None:
    """vLLM's `cache_salt`: a prompt cached under one salt is a hit for the same salt only;
    neither the unsalted request nor another salt reads its blocks, and the output is the same
    either way. An empty salt is a 400 naming the field."""
    story = " ".join(f"Verse {i} of a salted song." for i in range(40))

    def cached(salt: str | None) -> tuple[int, str]:
        extra = {} if salt is None else {"cache_salt": salt}
        done = client.completions.create(model=MODEL, prompt=story, max_tokens=4,
                                         temperature=0, extra_body=extra)
        return done.usage.prompt_tokens_details.cached_tokens, done.choices[0].text

    first, text = cached("tenant-a")
    assert first == 0
    again, same_text = cached("tenant-a")
    assert again > 0 and same_text == text
    assert cached(None) == (0, text)  # the unsalted chain is another chain
    assert cached("tenant-b") == (0, text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": story}], max_tokens=2,
        temperature=0, extra_body={"cache_salt": "tenant-c"})
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # the template's preamble too
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt" and "non-empty" in e.value.body["message"]


def test_chat_stream_shape_with_n_and_usage(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "n": 3, "temperature": 1.0,
            "ignore_eos": True,
            "seed": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers=server.headers, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    per_index: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        per_index[choice["index"]].append(choice)
    order = [c["choices"][0]["index"] for c in chunks[3:-1]]
    assert len(set(order)) == 3 and order != sorted(order), "choices should interleave"
    for choices in per_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in choices[1:])
        finishes = [c for c in choices if c["finish_reason"] is not None]
        assert len(finishes) == 1 and finishes[0] is choices[-1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3 * 12


def test_logprobs_in_both_formats(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4,
                                     temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 3 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values())  # greedy: the chosen token is the best
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob


def test_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3,
                                     temperature=0, echo=True, logprobs=1)
    choice = done.choices[0]
    assert choice.text.startswith("Hello there")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    only = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0,
                                     echo=True)
    assert only.choices[0].text == "Hello there"


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20,
                                     temperature=0).choices[0].text
    stop = full.strip()[2:4]
    assert stop.strip()
    done = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20,
                                     temperature=0, stop=[stop])
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and choice.text == full[: full.index(stop)]
    assert choice.model_extra["stop_reason"] == stop
    streamed = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20,
                                         temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_seeds_reproducible_across_requests_and_under_load(server: RunningServer) -> None:
    async def run() -> list[str]:
        client = server.async_client()
        seeded = [client.completions.create(model=MODEL, prompt="A story about a cat:",
                                            max_tokens=16, temperature=1.0, top_p=0.95,
                                            seed=1234) for _ in range(4)]
        noise = [client.completions.create(model=MODEL, prompt=f"Noise {i}", max_tokens=16,
                                           temperature=1.2) for i in range(4)]
        results = await asyncio.gather(*seeded, *noise)
        return [r.choices[0].text for r in results[:4]]

    alone = server.client().completions.create(
        model=MODEL, prompt="A story about a cat:", max_tokens=16, temperature=1.0, top_p=0.95,
        seed=1234).choices[0].text
    assert asyncio.run(run()) == [alone] * 4


@pytest.mark.parametrize("body,param,fragment", [
    ({"top_p": 2.0}, "top_p", "top_p must be in (0, 1], got 2.0"),
    ({"temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"n": "three"}, "n", "validation error"),
    ({"presence_penalty": 3}, "presence_penalty", "must be in [-2, 2]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"max_tokens": 4096}, "max_tokens", "'max_tokens' or 'max_completion_tokens' is too "
                                         "large: 4096. This model's maximum context length is "
                                         "4096 tokens and your request has 1 input tokens "
                                         "(4096 > 4096 - 1)."),
    ({"prompt": [99999999]}, "prompt", "out of vocabulary"),
    ({"prompt": "hello " * 5000}, "input_tokens", "maximum context length is 4096 tokens"),
    ({"extra_args": {"no_repeat_ngram_size": 0}}, "extra_args.no_repeat_ngram_size",
     "must be an integer >= 1"),
])
def test_bad_fields_are_400_naming_the_field(server: RunningServer, body: dict, param: str,
                                             fragment: str) -> None:
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 5, **body}
    response = server.post("/v1/completions", request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert error["code"] == 400 and error["type"] == "BadRequestError"


def test_chat_specific_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"At most 0 image\(s\) may be provided"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="content part type 'input_audio'"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}])
    with pytest.raises(openai.NotFoundError, match="The model `gpt-9` does not exist"):
        client.chat.completions.create(model="gpt-9", messages=CHAT)


def test_auth_on_every_route(server: RunningServer) -> None:
    # short answers: this checks who gets in, and an unbounded chat on a slow machine can
    # run past the client's timeout (it did: ~4,000 tokens of a sampled answer)
    routes = [("GET", "/v1/models", None),
              ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}),
              ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
              ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
              ("GET", "/metrics", None), ("GET", "/version", None)]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, server.url + path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == 401
        ok = httpx.request(method, server.url + path, json=body, headers=server.headers,
                           timeout=60)
        assert ok.status_code == 200, (path, ok.text)
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()


def test_tokenize_and_detokenize(server: RunningServer) -> None:
    ids = server.post("/tokenize", {"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 4096
    assert server.post("/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == \
        "Hello world"
    chat = server.post("/tokenize", {"messages": CHAT}).json()
    assert chat["count"] > ids["count"]


def test_metrics_move(server: RunningServer, client: openai.OpenAI) -> None:
    # tokens are counted as they are generated: no earlier test's request may still run
    wait_until(lambda: server.metric("nanoserve:num_requests_running") == 0,
               "earlier tests' requests to end")
    before = server.metric("nanoserve:generation_tokens_total")
    prompt_before = server.metric("nanoserve:prompt_tokens_total")
    ttft = server.metric("nanoserve:time_to_first_token_seconds_count")
    done = client.completions.create(model=MODEL, prompt="Metrics", max_tokens=5, temperature=0)
    assert server.metric("nanoserve:generation_tokens_total") == before + 5
    assert done.usage is not None and done.usage.prompt_tokens > 0
    assert server.metric("nanoserve:prompt_tokens_total") == \
        prompt_before + done.usage.prompt_tokens
    assert server.metric("nanoserve:time_to_first_token_seconds_count") == ttft + 1
    assert server.metric("nanoserve:prefix_cache_queries_total") > 0
    # the gauges follow a request in flight, and come back when it ends
    idle_usage = server.metric("nanoserve:kv_cache_usage_perc")
    generated = server.metric("nanoserve:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Gauges", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(20):  # each chunk carries at least one new token
            next(lines)
        assert server.metric("nanoserve:num_requests_running") == 1  # it is running now
        # tokens are counted as they stream, not when the request ends
        assert server.metric("nanoserve:generation_tokens_total") >= generated + 20
        assert server.metric("nanoserve:num_requests_waiting") == 0
        assert server.metric("nanoserve:kv_cache_usage_perc") > idle_usage
    wait_until(lambda: server.metric("nanoserve:num_requests_running") == 0,
               "the disconnected request to stop")


def test_disconnect_mid_stream_frees_everything(server: RunningServer) -> None:
    idle_usage = server.metric("nanoserve:kv_cache_usage_perc")
    body = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break
    assert server.metric("nanoserve:num_requests_running") <= 1
    wait_until(lambda: (server.metric("nanoserve:num_requests_running") == 0
                        and server.metric("nanoserve:kv_cache_usage_perc") == idle_usage),
               "the aborted request's blocks to come back")
    follow = server.client().completions.create(model=MODEL, prompt="After", max_tokens=3)
    assert follow.choices[0].finish_reason == "length"


def test_disconnect_while_waiting_aborts(server: RunningServer) -> None:
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"model": MODEL, "prompt": "Wait", "max_tokens": 3000,
                                        "ignore_eos": True}, timeout=1.0)
    wait_until(lambda: server.metric("nanoserve:num_requests_running") == 0,
               "the timed-out request to be aborted")

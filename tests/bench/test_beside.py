"""`nanoserve bench serve --long-prompt-beside`: the streams' gaps split by the long prompt's
arrival and first token, and the long prompt sent only once every stream has settled, against
a real HTTP server on loopback whose streams slow down while a long prompt is in."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from sse_server import serving

from nanoserve.bench.beside import SETTLE_TOKENS, format_beside, run_beside, split_gaps
from nanoserve.bench.load_client import RequestRecord, completion_body, make_session


def record(times: list[float]) -> RequestRecord:
    return RequestRecord(start=0.0, end=times[-1], chunk_times=times)


def test_gaps_are_split_by_when_they_ended() -> None:
    streams = [record([0.0, 1.0, 2.0, 5.0, 6.0]), record([0.5, 4.5, 9.0])]
    alone, beside = split_gaps(streams, arrived=2.0, first_token=5.0)
    assert sorted(alone) == [1.0, 1.0]
    assert sorted(beside) == [3.0, 4.0]  # 2.0 -> 5.0, and 0.5 -> 4.5; 4.5 -> 9.0 ends after


def chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def test_the_long_prompt_comes_after_every_stream_settled_and_its_wait_is_measured() -> None:
    sent: dict[str, int] = {}  # each stream's tokens sent so far
    at_arrival: dict[str, int] = {}
    long_in = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if body["prompt"] == "long":
            at_arrival.update(sent)
            long_in.set()
            await asyncio.sleep(0.3)  # its prefill
            long_in.clear()
            await response.write(chunk(" done"))
        else:
            sent[body["prompt"]] = 0
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.05 if long_in.is_set() else 0.002)
                sent[body["prompt"]] += 1
                await response.write(chunk(" x"))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def go():
        async with serving(handler) as url, make_session(4) as session:
            bodies = [completion_body("m", f"s{i}", 80) for i in range(3)]
            return await run_beside(session, url, bodies, completion_body("m", "long", 4),
                                    6000, {})

    stats = asyncio.run(go())
    assert len(at_arrival) == 3 and min(at_arrival.values()) >= SETTLE_TOKENS
    assert stats.streams == 3 and stats.failures == 0 and stats.prompt_tokens == 6000
    assert stats.long_ttft >= 0.3
    assert stats.beside_gaps > 0 and stats.beside[0] > stats.alone[0]
    table = format_beside("fake", [stats])
    assert table[0] == "fake: a long prompt beside running streams (gaps in ms)"
    assert table[2].split()[:2] == ["3", "6000"]

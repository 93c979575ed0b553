"""A long prompt beside running streams: what its prefill does to the streams already decoding.

`nanoserve bench serve --long-prompt-beside N`, per concurrency level C: C streams of the
level's prompts decode; once each has streamed `SETTLE_TOKENS` tokens, one request with an
N-token prompt arrives (a few output tokens). Each stream's gaps between tokens are split by
when the gap ended: before the long prompt arrived ("alone"), or while it waited for its first
token ("beside"). The table prints both gaps' p50 and p99, their ratio, and the long prompt's
time to first token: an agent's first turn must not stall the users already served, nor wait
forever behind them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from nanoserve.bench.load_client import RequestRecord, percentile, ratio, send_request, to_ms

SETTLE_TOKENS = 8  # tokens each stream has streamed before the long prompt is sent
OUTPUT_TOKENS = 4  # the long prompt's own output


@dataclass(frozen=True)
class BesideStats:
    """One level's figures (seconds)."""

    streams: int
    prompt_tokens: int
    alone: tuple[float, float]  # the streams' gap p50, p99 before the long prompt came
    beside: tuple[float, float]  # ... while it waited for its first token
    long_ttft: float
    failures: int
    beside_gaps: int  # how many gaps ended in the window (few: the streams ended too soon)


def split_gaps(streams: Sequence[RequestRecord], arrived: float, first_token: float
               ) -> tuple[list[float], list[float]]:
    """Every stream's gaps between consecutive tokens, as (those that ended before `arrived`,
    those that ended in (`arrived`, `first_token`])."""
    alone: list[float] = []
    beside: list[float] = []
    for record in streams:
        for before, after in itertools.pairwise(record.chunk_times):
            if after <= arrived:
                alone.append(after - before)
            elif after <= first_token:
                beside.append(after - before)
    return alone, beside


def beside_stats(streams: Sequence[RequestRecord], long: RequestRecord, arrived: float,
                 prompt_tokens: int) -> BesideStats:
    first_token = long.chunk_times[0] if long.chunk_times else long.end
    alone, beside = split_gaps(streams, arrived, first_token)
    return BesideStats(
        streams=len(streams), prompt_tokens=prompt_tokens,
        alone=(percentile(alone, 50), percentile(alone, 99)),
        beside=(percentile(beside, 50), percentile(beside, 99)),
        long_ttft=first_token - arrived,
        failures=sum(not r.ok for r in [*streams, long]), beside_gaps=len(beside))


async def run_beside(session: aiohttp.ClientSession, url: str,
                     stream_bodies: Sequence[dict[str, Any]], long_body: dict[str, Any],
                     prompt_tokens: int, headers: dict[str, str]) -> BesideStats:
    """The streams, then the long prompt once each stream has settled (or ended)."""
    streams = [RequestRecord(start=0.0) for _ in stream_bodies]
    tasks = [asyncio.create_task(send_request(session, url, body, headers, record=record))
             for body, record in zip(stream_bodies, streams, strict=True)]
    while not all(len(r.chunk_times) >= SETTLE_TOKENS or task.done()
                  for r, task in zip(streams, tasks, strict=True)):
        await asyncio.sleep(0.005)
    arrived = time.perf_counter()
    long = await send_request(session, url, long_body, headers)
    await asyncio.gather(*tasks)
    return beside_stats(streams, long, arrived, prompt_tokens)


def format_beside(name: str, levels: Sequence[BesideStats]) -> list[str]:
    """A row per level: the streams' gaps alone and beside the long prompt, and its TTFT."""
    lines = [f"{name}: a long prompt beside running streams (gaps in ms)",
             f"{'streams':>7} {'prompt':>7} {'alone p50':>10} {'p99':>7} {'beside p50':>11} "
             f"{'p99':>8} {'beside p99 / alone p50':>23} {'its TTFT ms':>12} {'gaps':>5}"]
    for s in levels:
        lines.append(
            f"{s.streams:>7} {s.prompt_tokens:>7} {to_ms(s.alone[0]):10.1f} "
            f"{to_ms(s.alone[1]):7.1f} {to_ms(s.beside[0]):11.1f} {to_ms(s.beside[1]):8.1f} "
            f"{ratio(s.beside[1], s.alone[0]):22.1f}x {to_ms(s.long_ttft):12.1f} "
            f"{s.beside_gaps:>5}")
    lines += [f"  {s.streams} streams: {s.failures} requests failed"
              for s in levels if s.failures]
    return lines

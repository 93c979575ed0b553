"""The load client of `nanoserve bench serve`: prompts, streamed requests, their timings,
and the tables. Pure functions where possible, so tests can run them on fake servers.

The requests go through aiohttp, as vLLM's `benchmark_serving` sends them. The client shares
the machine with the server it measures, so its CPU is the server's loss: streaming 4 x 256
tokens from `nanoserve serve` at one stream, httpx (its line reader or the raw bytes alike) took
0.47-0.54 ms of the client's CPU a token and aiohttp 0.23 ms, and the server gave 126-128 tok/s
to httpx against 131-134 to aiohttp."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Each is one token after a space in the BPE vocabularies of Llama/SmolLM2/Qwen-style models,
# so a prompt of n words is about n tokens.
_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new "
    "work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form great think say help low line "
    "before turn cause same mean differ move right boy old too does tell sentence set three want "
    "air well also play small end put home read hand port large spell add even land here must "
    "big high such follow act why ask men change went light kind off need house picture try us "
    "again animal point mother world near build self earth father head stand own page should "
    "country found answer school grow study still learn plant cover food sun four thought let "
    "keep eye never last door between city tree cross since hard start might story saw far sea "
    "draw left late run while press close night real life few stop open seem together next white "
    "children begin got walk example ease paper often always music those both mark book letter "
    "until mile river car feet care second group carry took rain eat room friend began idea fish "
    "mountain north once base hear horse cut sure watch color face wood main enough plain girl "
    "usual young ready above ever red list though feel talk bird soon body dog family direct "
    "pose leave song measure state product black short class wind question happen "
    "complete ship area half rock order fire south problem piece told knew pass farm top whole "
    "king size heard best hour better true during hundred am remember step early hold west "
    "ground interest reach fast five sing listen six table travel less morning ten simple "
    "several vowel toward war lay against pattern slow center love person money serve appear "
    "road map science rule govern pull cold notice voice fall power town fine certain fly unit "
    "lead cry dark machine note wait plan figure star box noun field rest correct able pound "
    "done beauty drive stood contain front teach week final gave green oh quick develop sleep "
    "warm free minute strong special mind behind clear tail produce fact street inch lot nothing "
    "course stay wheel full force blue object decide surface deep moon island foot yet busy test "
    "record boat common gold possible plane age dry wonder laugh thousand ago ran check game "
    "shape yes hot miss brought heat snow bed bring sit perhaps fill east weight language among"
)

COMMON_WORDS = tuple(_WORDS.split())

def make_prompts(count: int, input_len: int, seed: int) -> list[str]:
    """`count` prompts of `input_len` random common words (about that many tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(COMMON_WORDS) for _ in range(input_len)) for _ in range(count)]

def completion_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """A streamed, greedy, EOS-ignoring completion request for exactly `output_len` tokens."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()

@dataclass
class StreamEvent:
    """What one SSE payload says: its text (if any), usage tokens (if any), an error (if any)."""

    text: str = ""
    completion_tokens: int | None = None
    error: str | None = None
    done: bool = False

def parse_event(payload: str) -> StreamEvent:
    """Interpret one `data:` payload of a streamed /v1/completions response."""
    if payload == "[DONE]":
        return StreamEvent(done=True)
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        return StreamEvent(error=f"not JSON: {payload[:200]!r}")
    if not isinstance(chunk, dict):
        return StreamEvent(error=f"not a JSON object: {payload[:200]!r}")
    if chunk.get("error"):
        return StreamEvent(error=f"server error: {json.dumps(chunk['error'])[:300]}")
    event = StreamEvent()
    choices = chunk.get("choices") or []
    if choices and isinstance(choices[0], dict):  # completions' text, or chat's delta
        delta = choices[0].get("delta")
        event.text = choices[0].get("text") or (
            delta.get("content") if isinstance(delta, dict) else None) or ""
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        event.completion_tokens = usage["completion_tokens"]
    return event

@dataclass
class RequestRecord:
    """One request's timeline (perf_counter seconds) and outcome."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks with non-empty text
    text: str = ""  # the streamed text, in order
    usage_tokens: int | None = None
    error: str | None = None
    body: bytearray | None = None  # the raw response, when the caller asked to keep it

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def completion_tokens(self) -> int:
        """Usage's count when the server sent one, else one token per content chunk."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

def inter_token_latencies(chunk_times: Sequence[float], num_tokens: int) -> list[float]:
    """Per-token gaps between consecutive content chunks.

    A chunk may carry several tokens (a server holds text back while a character or a stop
    string is incomplete), and the stream does not say which. When the token count (from usage)
    exceeds the chunks, the surplus is spread evenly: each gap stands for (tokens - 1) / gaps
    tokens. Without usage, `num_tokens` is the chunk count and each gap is one token.
    """
    gaps = [b - a for a, b in itertools.pairwise(chunk_times)]
    if not gaps:
        return []
    tokens_per_gap = max(1.0, (num_tokens - 1) / len(gaps))
    return [gap / tokens_per_gap for gap in gaps]

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

@dataclass
class LevelStats:
    """The figures of one concurrency level (latencies in seconds)."""

    concurrency: int
    requests: int
    failures: int
    wall_s: float
    output_tokens: int
    ttft: tuple[float, float, float]  # p50, p90, p99
    itl: tuple[float, float, float]
    e2e_p50: float
    first_error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def requests_per_s(self) -> float:
        return (self.requests - self.failures) / self.wall_s if self.wall_s > 0 else math.nan

def _p50_90_99(values: Sequence[float]) -> tuple[float, float, float]:
    return percentile(values, 50), percentile(values, 90), percentile(values, 99)

def summarize(records: Sequence[RequestRecord], concurrency: int) -> LevelStats:
    """Aggregate one level; failed requests count as failures and nothing else.

    Wall time runs from the first send to the last completion, failed requests included.
    """
    good = [r for r in records if r.ok]
    wall = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    ttfts = [t for r in good if (t := r.ttft) is not None]
    itls = [gap for r in good for gap in inter_token_latencies(r.chunk_times,
                                                               r.completion_tokens)]
    first_error = next((r.error for r in records if r.error is not None), None)
    return LevelStats(concurrency=concurrency, requests=len(records),
                      failures=len(records) - len(good), wall_s=wall,
                      output_tokens=sum(r.completion_tokens for r in good),
                      ttft=_p50_90_99(ttfts), itl=_p50_90_99(itls),
                      e2e_p50=percentile([r.latency for r in good], 50),
                      first_error=first_error)

def requests_per_level(concurrency: int, num_requests: int | None) -> int:
    """`--num-requests` if given, else enough for the level to reach a steady state."""
    return num_requests if num_requests is not None else max(concurrency * 2, 8)

def parse_levels(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; each level must be positive."""
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs positive integers, got {text!r}")
    return levels

async def send_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       headers: dict[str, str], path: str = "/v1/completions",
                       keep_body: bool = False, record: RequestRecord | None = None
                       ) -> RequestRecord:
    """One streamed completion (or chat completion, by `path`); never raises (errors are
    recorded). With `keep_body` the response's bytes are kept in `record.body`. A `record`
    given is filled (and started now), so the caller can watch the stream as it arrives."""
    if record is None:
        record = RequestRecord(start=0.0, body=bytearray() if keep_body else None)
    record.start = time.perf_counter()
    try:
        async with session.post(url.rstrip("/") + path, json=body,
                                headers=headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                record.error = f"HTTP {response.status}: {text[:300]}"
            else:
                await _read_stream(response, record)
    except Exception as e:  # any failure of one request is a figure, not a crash
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    return record

async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    pending = b""  # a line cut by the network, waiting for its end
    async for chunk in response.content.iter_any():
        if record.body is not None:
            record.body += chunk
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if _take_line(line.decode(errors="replace"), record):
                return
    if pending and _take_line(pending.decode(errors="replace"), record):
        return
    record.error = "the stream ended without data: [DONE]"

def _take_line(line: str, record: RequestRecord) -> bool:
    """Apply one SSE line to the record; True when the stream is over ([DONE] or an error)."""
    payload = sse_data(line)
    if payload is None:
        return False
    event = parse_event(payload)
    if event.done:
        return True
    if event.error is not None:
        record.error = event.error
        return True
    if event.text:
        record.chunk_times.append(time.perf_counter())
        record.text += event.text
    if event.completion_tokens is not None:
        record.usage_tokens = event.completion_tokens
    return False

async def run_level(session: aiohttp.ClientSession, url: str, bodies: Sequence[dict[str, Any]],
                    concurrency: int, headers: dict[str, str],
                    path: str = "/v1/completions", keep_bodies: bool = False
                    ) -> list[RequestRecord]:
    """Send every body with at most `concurrency` requests in flight; records in body order."""
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(body: dict[str, Any]) -> RequestRecord:
        async with semaphore:
            return await send_request(session, url, body, headers, path, keep_bodies)

    return list(await asyncio.gather(*(limited(body) for body in bodies)))

def make_session(max_concurrency: int) -> aiohttp.ClientSession:
    """A session with a connection per request in flight and patience for long queues.

    Each request opens its own connection and closes it, as vLLM's benchmark (a session per
    request) does: llama-server closes a kept-alive connection after a few requests, and a
    request sent on one it was closing failed with "Server disconnected" (11 of 64 at 32
    streams in one run)."""
    # The read timeout bounds the wait for the next chunk, which at high concurrency on a CPU
    # includes the queue before the first token; ten minutes is far past any sane figure.
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=600.0),
        connector=aiohttp.TCPConnector(limit=max_concurrency + 4, force_close=True))

async def served_model_name(session: aiohttp.ClientSession, url: str,
                            headers: dict[str, str]) -> str | None:
    """The first model id in `GET /v1/models`; None if the server lists none."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models", headers=headers) as response:
            data = (await response.json(content_type=None)).get("data") or []
            if response.status == 200 and data and isinstance(data[0].get("id"), str):
                return str(data[0]["id"])
    except Exception:  # a server without /v1/models is still benchmarked, with a default name
        pass
    return None

@dataclass
class ServerRun:
    """All levels measured against one server."""

    name: str
    model: str
    levels: list[LevelStats]
    more_tables: list[list[str]] = field(default_factory=list)  # printed after its own

def to_ms(seconds: float) -> float:
    return seconds * 1e3

def format_table(run: ServerRun) -> list[str]:
    """One server's figures, a row per concurrency level (latencies in ms)."""
    lines = [f"{run.name} (model {run.model})",
             f"{'concurrency':>11} {'requests':>9} {'failed':>7} {'tok/s':>8} {'req/s':>7} "
             f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} {'p99':>7} "
             f"{'E2E p50':>9}"]
    for s in run.levels:
        lines.append(
            f"{s.concurrency:>11} {s.requests:>9} {s.failures:>7} {s.tokens_per_s:8.1f} "
            f"{s.requests_per_s:7.2f} {to_ms(s.ttft[0]):9.1f} {to_ms(s.ttft[1]):8.1f} "
            f"{to_ms(s.ttft[2]):8.1f} {to_ms(s.itl[0]):8.1f} {to_ms(s.itl[1]):7.1f} "
            f"{to_ms(s.itl[2]):7.1f} {to_ms(s.e2e_p50):9.1f}")
    lines += [f"  concurrency {s.concurrency}: first error: {s.first_error}"
              for s in run.levels if s.first_error]
    return lines

def ratio(ours: float, theirs: float) -> float:
    """ours / theirs, NaN where undefined (a level with no successful request)."""
    if theirs == 0 or math.isnan(theirs) or math.isnan(ours):
        return math.nan
    return ours / theirs

def format_comparison(ours: ServerRun, theirs: ServerRun) -> list[str]:
    """tok/s and TTFT p50 side by side with ratios ours / theirs, per concurrency level."""
    lines = [f"{ours.name} / {theirs.name}",
             f"{'concurrency':>11} {'tok/s':>9} {'peer tok/s':>11} {'ratio':>7} "
             f"{'TTFT p50 ms':>12} {'peer TTFT p50 ms':>17} {'ratio':>7}"]
    for a, b in zip(ours.levels, theirs.levels, strict=True):
        lines.append(
            f"{a.concurrency:>11} {a.tokens_per_s:9.1f} {b.tokens_per_s:11.1f} "
            f"{ratio(a.tokens_per_s, b.tokens_per_s):6.2f}x {to_ms(a.ttft[0]):12.1f} "
            f"{to_ms(b.ttft[0]):17.1f} {ratio(a.ttft[0], b.ttft[0]):6.2f}x")
    return lines

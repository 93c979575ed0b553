"""`bench spec` beside llama-server: its flags, its `timings`, and the report's ratios.

No model: cells are filled by hand, streams replayed by a loopback server (tests/sse_server.py).
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
from aiohttp import web
from sse_server import replay, serving

from nanoserve.bench.load_client import RequestRecord, make_session, send_request
from nanoserve.bench.spec import Cell, best_peer, format_report, target_lines
from nanoserve.bench.spec_peer import (
    Drafts,
    peer_server_args,
    peer_spec_types,
    timings_drafts,
)

# The shape of a llama-server chat stream: content chunks, then the finishing chunk with the
# request's cumulative `timings`, then usage.
LLAMA_STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}],"object":"chat.completion.chunk"}'
    b'\n\ndata: {"choices":[{"index":0,"delta":{"content":" there"}}]}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"timings":{"prompt_n":'
    b'9,"predicted_n":2,"draft_n":8,"draft_n_accepted":5}}\n\n'
    b'data: {"choices":[],"usage":{"completion_tokens":2,"prompt_tokens":9}}\n\n'
    b"data: [DONE]\n\n")


def test_each_ngram_type_gets_its_own_draft_length_flag() -> None:
    assert peer_server_args("none", 4) == []
    assert peer_server_args("ngram-simple", 4) == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "4",
        "--spec-ngram-simple-size-n", "4"]  # its default 12 would never draft 4
    assert peer_server_args("ngram-simple", 16)[-1] == "12"
    assert peer_server_args("ngram-mod", 6) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "6"]
    assert peer_server_args("ngram-cache", 4) == ["--spec-type", "ngram-cache"]


def test_no_peer_and_an_empty_list_both_run_no_llama_server() -> None:
    on = argparse.Namespace(no_peer=False, peer_spec_types="none, ngram-mod,")
    assert peer_spec_types(on) == ["none", "ngram-mod"]
    assert peer_spec_types(argparse.Namespace(no_peer=False, peer_spec_types="")) == []
    assert peer_spec_types(argparse.Namespace(no_peer=True, peer_spec_types="none")) == []


def test_timings_are_read_from_streams_and_whole_bodies() -> None:
    whole = b'{"choices":[{"message":{"content":"x"}}],"timings":{"draft_n":4,' \
            b'"draft_n_accepted":1}}'
    undrafted = LLAMA_STREAM.replace(b',"draft_n":8,"draft_n_accepted":5', b"")
    drafts = timings_drafts([LLAMA_STREAM, whole, undrafted])
    assert drafts == Drafts(None, 12.0, 6.0)
    assert drafts.accepted_per_draft_token == pytest.approx(0.5)
    assert drafts.mean_accepted_length is None  # llama-server counts no drafting steps
    assert timings_drafts([undrafted]).accepted_per_draft_token is None


def test_drafts_add_up_and_give_the_mean_accepted_length() -> None:
    total = Drafts(10.0, 40.0, 25.0) + Drafts(10.0, 40.0, 15.0)
    assert total == Drafts(20.0, 80.0, 40.0)
    assert total.mean_accepted_length == pytest.approx(3.0)
    assert (total + Drafts(None, 1.0, 1.0)).num_drafts is None


@pytest.mark.parametrize("keep_body", [True, False])
def test_the_client_keeps_a_streams_bytes_when_asked(keep_body: bool) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await replay(request, [LLAMA_STREAM[:50], LLAMA_STREAM[50:]])

    async def go() -> RequestRecord:
        async with serving(handler) as url, make_session(1) as session:
            return await send_request(session, url, {}, {}, "/v1/chat/completions",
                                      keep_body=keep_body)

    record = asyncio.run(go())
    assert record.ok and record.text == "Hi there" and record.usage_tokens == 2
    assert record.body == (LLAMA_STREAM if keep_body else None)


def cell(speed: float, drafts: Drafts | None = None, text: str = "a",
         output_tokens: int = 0) -> Cell:
    return Cell(tokens_per_s=[speed, speed], itl_p50=[5.0], itl_p99=[9.0], texts=[text],
                drafts=drafts, output_tokens=output_tokens)


SERVERS = ["off", "ngram", "llama:none", "llama:ngram-mod"]
PLAN = [("rename", 1), ("chat", 8)]


def results() -> dict[str, dict[tuple[str, int], Cell]]:
    return {"off": {("rename", 1): cell(100.0), ("chat", 8): cell(300.0)},
            "ngram": {("rename", 1): cell(240.0, Drafts(50.0, 200.0, 100.0), output_tokens=300),
                      ("chat", 8): cell(290.0, Drafts(5.0, 20.0, 1.0), text="b")},
            "llama:none": {("rename", 1): cell(110.0), ("chat", 8): cell(350.0)},
            "llama:ngram-mod": {("rename", 1): cell(150.0, Drafts(None, 80.0, 60.0),
                                                         output_tokens=300),
                                ("chat", 8): cell(320.0)}}


def test_the_best_peer_is_the_fastest_llama_server_row_none_included() -> None:
    assert best_peer(results(), SERVERS, ("rename", 1)) == ("llama:ngram-mod", 150.0)
    assert best_peer(results(), SERVERS, ("chat", 8)) == ("llama:none", 350.0)
    assert best_peer(results(), ["off", "ngram"], ("chat", 8)) is None


def test_report_rows_give_ratios_against_off_and_the_best_peer() -> None:
    args = argparse.Namespace(max_tokens=96, rounds=2, num_speculative_tokens=4)
    rows = {tuple(line.split()[:3]): line.split()
            for line in format_report(results(), SERVERS, PLAN, args)}
    # tok/s, vs off, vs llama, ITL p50, p99, acc/tok, acc len, tok/step, drafted, rows/step,
    # step cost, same text: 300 tokens with 100 accepted took 200 request-steps, 50 of them
    # drafting 200 tokens (2 rows a step), each step 1.5 / 2.4 of off's
    assert rows["rename", "1", "ngram"][3:] == [
        "240.0", "2.40x", "1.60x", "5.0", "9.0", "0.50", "3.00", "1.50", "0.25", "2.00",
        "0.62", "yes"]
    assert rows["rename", "1", "llama:ngram-mod"][3:] == [
        "150.0", "1.50x", "best", "5.0", "9.0", "0.75", "-", "1.25", "-", "1.33", "0.83", "-"]
    assert rows["rename", "1", "off"][-3:] == ["-", "-", "-"]  # no tokens counted here
    assert rows["rename", "1", "llama:none"][5] == "-"
    assert rows["chat", "8", "ngram"][5] == "0.83x" and rows["chat", "8", "ngram"][-1] == "NO"
    assert rows["chat", "8", "llama:none"][5] == "best"


def test_target_lines_name_the_lowest_copying_ratio() -> None:
    lines = target_lines(results(), SERVERS, PLAN)
    assert "target >= 1.50x" in lines[0]
    assert lines[1].split() == ["off", "rename", "0.67x", "lowest", "0.67x", "(below)"]
    assert lines[2].split() == ["ngram", "rename", "1.60x", "lowest", "1.60x", "(meets)"]
    assert target_lines(results(), ["off", "ngram"], PLAN) == []

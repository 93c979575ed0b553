"""A client that stops reading its stream: the server aborts its request after a bounded time
(--slow-reader-timeout) or a bounded backlog (--max-unread-updates), frees its blocks, and keeps
serving everyone else."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from server_harness import RunningServer, wait_until

# 64 samples of 900 tokens, ~200 bytes an event: ~12 MB, far more than the sockets can buffer
# (the kernel's send buffer grows to a few MB)
BODY = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True, "n": 64,
        "temperature": 1.0}


def stalled_client(server: RunningServer) -> socket.socket:
    """A stream request from a socket with a tiny receive buffer that reads the response's
    first bytes and then nothing more (kept open: closing it would be a disconnect)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps(BODY).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


@pytest.fixture
def server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    # Either limit can fire first: the unread updates wait 2 s, or 40 of them pile up.
    running = RunningServer(str(tiny_model_dir("llama")), "--slow-reader-timeout", "2",
                            "--max-unread-updates", "40")
    yield running
    running.stop()


def test_a_stalled_reader_is_aborted_and_others_go_on(server: RunningServer) -> None:
    sock = stalled_client(server)
    try:
        wait_until(lambda: server.metric("nanoserve:num_requests_running") >= 1,
                   "the stalled request to run")
        # while it is stalled, another client is served whole
        reply = server.post("/v1/completions", {"prompt": "y", "max_tokens": 8,
                                                "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == \
            "length"
        wait_until(lambda: (server.metric("nanoserve:num_requests_running") == 0
                            and server.metric("nanoserve:kv_cache_blocks_in_use") == 0),
                   "the stalled request to be aborted and its blocks freed", timeout=120)
    finally:
        sock.close()

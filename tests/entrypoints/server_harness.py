"""Start the real `nanoserve serve` as a subprocess, talk to it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that are all free now (a server that binds a
    port plus an offset, such as data-parallel engines' KV-event sockets, needs the run)."""
    for _ in range(100):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"found no run of {count} free ports")


class RunningServer:
    """`nanoserve serve ...` on a free port; `stop()` sends SIGTERM and waits.

    The constructor waits until the server is healthy; with `wait=False` it returns once the
    process is started, and the caller does other work (starts another server, loads a model)
    before `wait_healthy()`: a start is seconds of one core, and the machine has two."""

    def __init__(self, *args: str, api_key: str | None = None, log: Path | None = None,
                 wait: bool = True, env: dict[str, str] | None = None,
                 own_session: bool = False, ca_file: Path | None = None) -> None:
        """`own_session`: the server leads a process group of its own (as under a service
        manager or a terminal), so a test can signal the whole group. `ca_file`: the server
        serves HTTPS (its `--ssl-*` flags among `args`) with a certificate for localhost this
        CA signed, which every call here trusts."""
        self.port = free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--port",
               str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        # the server's output: to `log` when asked for, else to a temporary file that shows
        # its last lines if it exits while starting
        self.log_path = log
        self.log = open(log, "w") if log else tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env},
                                     start_new_session=own_session)
        self.verify: ssl.SSLContext | bool = (
            True if ca_file is None else ssl.create_default_context(cafile=str(ca_file)))
        self.url = (f"http://127.0.0.1:{self.port}" if ca_file is None
                    else f"https://localhost:{self.port}")
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 240.0) -> None:
        """Return once /health says 200; raise, the server stopped, if it exits first or
        `timeout` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting; "
                                   f"its last lines:\n{self.output_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def output_tail(self, num_lines: int = 20) -> str:
        """The last lines the server wrote (stdout and stderr together)."""
        self.log.flush()
        path = self.log_path
        if path is not None:
            text = path.read_text(errors="replace")
        else:
            self.log.seek(0)
            text = self.log.read()
        return "\n".join(text.splitlines()[-num_lines:])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        if self.verify is not True:
            kwargs.setdefault("http_client", httpx.Client(verify=self.verify))
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                                  max_retries=0)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=timeout,
                          verify=self.verify)

    def metric(self, name: str) -> float:
        """The value of one Prometheus sample (summed over label sets)."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"metric {name} not exported"
        return total

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 30.0,
               interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy (and return that): tests wait on a
    state, never for a fixed time. Raises AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def process_gone(pid: int) -> bool:
    """True once process `pid` has exited (a zombie awaiting its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a server-sent-event stream, in order."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def stream_chat(client: openai.OpenAI, model: str, messages: Any, max_tokens: int) -> str:
    """One greedy streamed chat read to its end; its finish reason ("stop" or "length")."""
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True)
    finish = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish in ("stop", "length")
    return str(finish)

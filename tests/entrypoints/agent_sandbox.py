"""Run one command of a real agent CLI (Claude Code, Codex) against a real `nanoserve serve`,
inside a network namespace that has nothing but loopback, so no client can phone home.

`run_in_sandbox` starts this file as a program under `unshare --net` (the namespace's `lo`
brought up with `ip link set lo up`; that needs root, or user namespaces: `sandbox_problem()`
says why not, for a skip). Inside, `_main` starts the server (`server_harness.RunningServer`),
a recording proxy in front of it, runs the command against the proxy's URL, and writes back
its exit code, stdout, stderr, the server's log and every HTTP request the command made
(method, path, status, body), since the server itself keeps no access log.

`{url}` (the base URL, no trailing slash) and `{api_key}` in the command's arguments and in
`env`'s values are replaced inside the sandbox, where the ports are chosen. The command gets
this process's environment, without proxy variables, updated with `env`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                    "ALL_PROXY")
_HOP_HEADERS = (b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive")


@dataclass(frozen=True)
class AgentRequest:
    """One HTTP request the command made, and the server's status."""

    method: str
    path: str  # with its query string
    status: int
    body: str = ""  # the request body, as text
    # seconds from the request to the first chunk of its answer that carries generated text
    # (a streamed delta), or to the whole answer where nothing is streamed
    first_token_s: float = 0.0


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # the command's; -9 when it ran past the timeout and was killed
    stdout: str
    stderr: str
    server_log: str
    requests: list[AgentRequest] = field(default_factory=list)

    @property
    def failed_requests(self) -> list[AgentRequest]:
        """The requests the server answered with a 4xx or 5xx."""
        return [r for r in self.requests if r.status >= 400]

    def describe(self) -> str:
        """Everything a failed assertion should show."""
        lines = [f"exit {self.returncode}", "requests:"]
        lines += [f"  {r.method} {r.path} -> {r.status}" for r in self.requests]
        lines += ["stdout:", self.stdout[-3000:], "stderr:", self.stderr[-3000:],
                  "server log:", self.server_log[-4000:]]
        return "\n".join(lines)


def sandbox_problem() -> str | None:
    """Why commands cannot run in a loopback-only namespace here, or None when they can."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --net is not permitted here: {probe.stderr.strip()}"
    return None


def run_in_sandbox(command: Sequence[str], *, server_args: Sequence[str] = (),
                   env: Mapping[str, str] | None = None, api_key: str | None = None,
                   cwd: Path | None = None, timeout: float = 300.0) -> SandboxResult:
    """Start `nanoserve serve *server_args` (with `api_key`), run `command` against it (in
    `cwd`, at most `timeout` seconds), all inside the namespace; see the module."""
    with tempfile.TemporaryDirectory(prefix="agent-sandbox-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({
            "command": list(command), "server_args": list(server_args), "env": dict(env or {}),
            "api_key": api_key, "cwd": str(cwd) if cwd else None, "timeout": timeout,
            "log": str(Path(tmp) / "server.log")}))
        inner = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                 sys.executable, str(Path(__file__).resolve()), str(spec_path),
                 str(result_path)]
        done = subprocess.run(inner, capture_output=True, text=True, timeout=timeout + 400)
        if not result_path.exists():
            raise RuntimeError(f"the sandbox failed (exit {done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result = json.loads(result_path.read_text())
    result["requests"] = [AgentRequest(**r) for r in result["requests"]]
    return SandboxResult(**result)


# -- inside the namespace ----------------------------------------------------------------


def _proxy(upstream: str, log: list[AgentRequest]) -> Any:
    """An ASGI app that forwards every request to `upstream`, streaming the answer back (an
    event stream arrives as it is sent), and logs each request with the status it got."""
    import httpx

    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        path = scope["path"] + (f"?{scope['query_string'].decode()}"
                                if scope["query_string"] else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_HEADERS]
        request = client.build_request(scope["method"], path, headers=headers, content=body)
        started = time.perf_counter()
        response = await client.send(request, stream=True)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw
                                if k.lower() not in _HOP_HEADERS]})
        first_token = 0.0
        async for chunk in response.aiter_raw():
            if not first_token and b"delta" in chunk:
                first_token = time.perf_counter() - started
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        await response.aclose()
        log.append(AgentRequest(scope["method"], path, response.status_code,
                                body.decode("utf-8", "replace"),
                                first_token or time.perf_counter() - started))

    return app


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    import uvicorn
    from server_harness import RunningServer, free_port

    server = RunningServer(*spec["server_args"], api_key=spec["api_key"], log=Path(spec["log"]))
    requests: list[AgentRequest] = []
    port = free_port()
    proxy = uvicorn.Server(uvicorn.Config(_proxy(server.url, requests), host="127.0.0.1",
                                          port=port, log_level="warning", lifespan="off"))
    proxy_task = asyncio.create_task(proxy.serve())
    try:
        while not proxy.started:
            await asyncio.sleep(0.05)
        names = {"url": f"http://127.0.0.1:{port}", "api_key": spec["api_key"] or ""}
        env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARIABLES}
        env.update({k: _fill(v, names) for k, v in spec["env"].items()})
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        proc = await asyncio.create_subprocess_exec(
            *[_fill(arg, names) for arg in spec["command"]], env=env, cwd=spec["cwd"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), spec["timeout"])
            returncode = proc.returncode
        except TimeoutError:
            out, err, returncode = b"", b"timed out", -9
        finally:  # the command's own children too (an agent's tools, its helpers)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proxy.should_exit = True
        await proxy_task
        server.stop()
    return {"returncode": returncode, "stdout": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace"),
            "server_log": Path(spec["log"]).read_text(errors="replace"),
            "requests": [asdict(r) for r in requests]}


def _fill(text: str, names: dict[str, str]) -> str:
    """`{url}` and `{api_key}` replaced; every other brace kept (JSON, shell, curl's -w)."""
    for name, value in names.items():
        text = text.replace("{" + name + "}", value)
    return text


def _main(spec_path: str, result_path: str) -> None:
    sys.path.insert(0, str(HERE))  # server_harness
    result = asyncio.run(_run(json.loads(Path(spec_path).read_text())))
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])

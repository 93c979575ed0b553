"""One model's own `nanoserve serve`: a child process on a loopback port of its own, with its
engine core, KV cache and prefix cache, started when the router loads the model and stopped
when it unloads it (its process group goes with it, so its memory is given back).

The child is the single-model server: it answers every endpoint, the router only forwards.
Its stops are the router's (engine/stop_signals.py): started `--stopped-by-parent`, it ignores
the signals a service manager or a terminal sends the whole group and drains on the router's
PARENT_STOP_SIGNAL, which it also gets if the router dies (PR_SET_PDEATHSIG), so a killed
router leaves no model behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

import httpx

from nanoserve.engine.stop_signals import PARENT_STOP_SIGNAL, STOP_SIGNALS, held_for_children
from nanoserve.entrypoints.router.catalog import chat_template_beside, mmproj_beside

_PR_SET_PDEATHSIG = 1
_HEALTH_POLL_S = 0.2
_LOG_LINES_SHOWN = 12  # of a failed start's output, in the error the client gets


class LoadError(RuntimeError):
    """A model's server failed to start; the message says why (its last lines of output)."""


def _tie_to_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Stop signals ignored across the exec (they are held meanwhile); the router's death
    delivered as its stop."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, PARENT_STOP_SIGNAL)


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ModelServer:
    """A started child server. `start` returns once it answers /health (or raises LoadError);
    `exited` completes when the process ends, for whatever reason."""

    def __init__(self, name: str, path: Path, args: list[str]) -> None:
        self.name = name
        self.path = path
        self.args = args  # the router's own flags for every model (run.py: child_args)
        self.port = 0
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.started_at = 0.0
        self._tail: deque[str] = deque(maxlen=_LOG_LINES_SHOWN)
        self._relay: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self, timeout: float) -> None:
        self.port = free_loopback_port()
        template, mmproj = chat_template_beside(self.path), mmproj_beside(self.path)
        own = [] if template is None else ["--chat-template", str(template)]
        own += [] if mmproj is None else ["--mmproj", str(mmproj)]
        with held_for_children():
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", str(self.path),
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name",
                self.name, "--no-web-ui", "--stopped-by-parent", *self.args, *own,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=_tie_to_parent)
        self._relay = asyncio.create_task(self._relay_output())
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self.process.returncode is not None:
                    with contextlib.suppress(asyncio.TimeoutError):  # its last lines
                        await asyncio.wait_for(asyncio.shield(self._relay), 2.0)
                    raise LoadError(f"the server of model {self.name!r} exited with status "
                                    f"{self.process.returncode} while loading: "
                                    f"{self.output_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        self.started_at = time.time()
                        return
                if time.monotonic() > deadline:
                    await self.stop(grace=1.0)
                    raise LoadError(f"model {self.name!r} did not load in {timeout:.0f} s")
                await asyncio.sleep(_HEALTH_POLL_S)

    async def exited(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    async def stop(self, grace: float) -> None:
        """PARENT_STOP_SIGNAL (the server drains, then stops its engine core, which writes its
        disk tier), then after `grace` seconds SIGKILL to its whole process group; returns
        once the process is gone."""
        self.stopping = True
        proc = self.process
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(PARENT_STOP_SIGNAL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        # the engine core and anything else the child started share its process group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if self._relay is not None:
            await self._relay

    def kill(self) -> None:
        """SIGKILL to its whole process group now (the router's second stop signal)."""
        self.stopping = True
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    async def _relay_output(self) -> None:
        """The child's output onto the router's, each line tagged with the model's name (as
        llama-server's router mode shows its children's); the last lines kept for errors."""
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def output_tail(self) -> str:
        """The child's last lines of output, for an error message."""
        return " | ".join(line for line in self._tail if line) or "(no output)"

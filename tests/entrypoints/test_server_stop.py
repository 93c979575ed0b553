"""Every way a user stops a server ends the same way (engine/stop_signals.py): the request in
flight streams to its end, the prefix cache's blocks are on `--kv-cache-disk`, the next server
over that folder reports them as `cached_tokens`, the exit status is 0 and no process is left.

The ways: SIGTERM to the main process; to its process group (`kill -- -PGID`, supervisord's
`stopasgroup`, and what systemd's default `KillMode=control-group` reaches here); Ctrl-C
(SIGINT to the foreground group) with two API processes; a terminal's hang-up (SIGHUP to the
group); and SIGTERM to every process of a `--models-dir` router's tree, its model servers in
sessions of their own.
The servers run one after another over one folder: each one's first request is the prompt the
one before it was stopped with, so each start checks the stop before it. The last one is
stopped twice, 1.5 s apart: the second signal stops it at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from process_tree import signal_tree, still_running, tree
from server_harness import RunningServer, wait_until

pytestmark = pytest.mark.server

MAX_TOKENS = 300
PROMPT_LEN = 330  # 20 full blocks of 16
CACHED = (PROMPT_LEN - 1) // 16 * 16
# the last stream must outlive two signals 1.5 s apart: as long as the tiny model's 1,024 allow
LONGEST_MAX_TOKENS = 1024 - PROMPT_LEN - 1
STOPPED_WITHIN_S = 60.0


def prompt(way: int) -> list[int]:
    """The token ids the server of `way` is stopped with (its own: no block shared)."""
    rng = random.Random(way)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)]


@dataclass(frozen=True)
class Way:
    name: str
    stop: Callable[[RunningServer], Any]  # sends the signal(s)
    args: tuple[str, ...] = ()
    is_router: bool = False


def to_group(signum: int) -> Callable[[RunningServer], Any]:
    return lambda server: os.killpg(server.proc.pid, signum)


WAYS = [
    Way("SIGTERM to the main process", lambda s: s.proc.send_signal(signal.SIGTERM)),
    Way("SIGTERM to the process group (kill -- -PGID, systemd, supervisord)",
        to_group(signal.SIGTERM)),
    Way("Ctrl-C (SIGINT to the group), two API processes", to_group(signal.SIGINT),
        ("--api-server-count", "2")),
    Way("a hang-up (SIGHUP to the group)", to_group(signal.SIGHUP)),
    # systemd's control group reaches the model servers too, in their own sessions
    Way("a router's SIGTERM to every process", lambda s: signal_tree(s.proc.pid, signal.SIGTERM),
        is_router=True),
]


class Stream:
    """One long streamed completion on a thread: its chunks counted, its end recorded."""

    def __init__(self, server: RunningServer, model: str, prompt_ids: list[int],
                 max_tokens: int = MAX_TOKENS) -> None:
        self.num_chunks = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._run, args=(server.url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        self.error = line
                    for choice in chunk.get("choices", []):
                        self.num_chunks += 1
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    self.usage = chunk.get("usage") or self.usage
        except httpx.HTTPError as e:
            self.error = repr(e)

    def wait_started(self) -> None:
        wait_until(lambda: self.num_chunks > 0 or not self.thread.is_alive(),
                   "the stream's first chunk", timeout=60)
        assert self.num_chunks > 0, self.error

    def join(self) -> None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "the stream hung"


def start(way: Way, disk: Path, models: Path, model_dir: Path,
          extra: tuple[str, ...] = ()) -> tuple[RunningServer, str]:
    common = ("--kv-cache-disk", str(disk), *way.args, *extra)
    if way.is_router:
        return RunningServer("--models-dir", str(models), *common, own_session=True), "tiny"
    return RunningServer(str(model_dir), *common, own_session=True), str(model_dir)


def cached_tokens(server: RunningServer, model: str, prompt_ids: list[int]) -> int:
    answer = server.client().completions.create(model=model, prompt=prompt_ids, max_tokens=1,
                                                temperature=0)
    details = answer.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def stopped(server: RunningServer, pids: set[int], why: str) -> int:
    """Wait until every process of the server's tree as it was (`pids`) and of its group is
    gone; its exit status. Kills what is left, and fails naming it, past the deadline."""
    def gone() -> bool:
        return not still_running(pids | tree(server.proc.pid))

    try:
        wait_until(gone, f"every process to exit after {why}", timeout=STOPPED_WITHIN_S)
    except AssertionError:
        left = still_running(pids | tree(server.proc.pid))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"{why}: still running {left}\n{server.output_tail()}") from None
    return int(server.proc.wait(timeout=10))


def test_every_way_of_stopping_drains_writes_the_disk_tier_and_leaves_nothing(
        tmp_path: Path, tiny_model_dir: Callable[[str], Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # where paced_output lives
    model_dir = tiny_model_dir("llama")
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny").symlink_to(model_dir)
    disk = tmp_path / "kv"
    for k, way in enumerate([*WAYS, None]):
        # the double signal's stream paced, so that it is still running at the second one
        server, model = start(way or WAYS[0], disk, models, model_dir,
                              () if way else ("--logits-processors", "paced_output:PacedSteps"))
        try:
            if k > 0:  # the stop before this start wrote its blocks
                assert cached_tokens(server, model, prompt(k - 1)) == CACHED, \
                    f"after {WAYS[k - 1].name}: not on disk"
            stream = Stream(server, model, prompt(k),
                            MAX_TOKENS if way else LONGEST_MAX_TOKENS)
            stream.wait_started()
            pids = tree(server.proc.pid)
            if way is None:
                _stop_twice(server, stream, pids)
                return
            way.stop(server)
            seen_at_stop = stream.num_chunks
            if k == 0:  # draining: refused with 503 while the stream goes on
                wait_until(lambda s=server: _health(s) == 503, "/health to say 503")
                assert server.post("/v1/completions", {"prompt": "y"}).status_code == 503
            stream.join()
            assert stream.error is None, f"{way.name}: {stream.error}"
            assert seen_at_stop < MAX_TOKENS, f"{way.name}: the stream was over before the stop"
            assert stream.finish_reason == "length", way.name
            assert stream.usage and stream.usage["completion_tokens"] == MAX_TOKENS, way.name
            assert stopped(server, pids, way.name) == 0, server.output_tail()
            assert "Traceback" not in server.output_tail(200), server.output_tail()
        finally:
            if server.proc.poll() is None:
                signal_tree(server.proc.pid, signal.SIGKILL)
            server.log.close()


def _stop_twice(server: RunningServer, stream: Stream, pids: set[int]) -> None:
    """A second signal, past the one-second window of a forwarded duplicate: stop at once,
    the stream cut short."""
    os.killpg(server.proc.pid, signal.SIGTERM)
    time.sleep(1.5)
    os.killpg(server.proc.pid, signal.SIGTERM)
    stopped_at = time.monotonic()
    stopped(server, pids, "two SIGTERMs")
    assert time.monotonic() - stopped_at < 10, "a second signal did not stop it at once"
    stream.join()
    assert stream.finish_reason != "length" or stream.error, "the stream was not cut short"


def _health(server: RunningServer) -> int | None:
    try:
        return httpx.get(server.url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None

"""A server with small limits on the tiny model, shared by the modules that check limits,
hostile inputs and the default security settings. Starting one costs seconds, so the first
module that asks starts it and the session's end stops it. (Not a conftest.py: a second
`conftest` module would shadow tests/conftest.py for `from conftest import ...`.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import RunningServer

MODEL = "tiny"
# small, so that a test can step just past each limit cheaply
LIMITS = {"--max-n": "4", "--max-stop-strings": "2", "--max-stop-string-length": "8",
          "--max-bad-words": "2",
          "--max-request-body-bytes": "262144", "--max-logprobs": "5",
          "--max-model-len": "256", "--max-in-flight": "8"}


LimitedServer = RunningServer  # its log (level info) is kept in `log_path`
_shared: list[RunningServer] = []


def shared_limited_server(request: pytest.FixtureRequest, model_dir: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> LimitedServer:
    """The session's limited server on `model_dir`, started on first use."""
    if not _shared:
        log_path = tmp_path_factory.mktemp("limited-server") / "server.log"
        args = [item for pair in LIMITS.items() for item in pair]
        server = RunningServer(str(model_dir), *args, "--served-model-name", MODEL,
                               "--log-level", "info", log=log_path)
        _shared.append(server)
        request.session.addfinalizer(_stop_shared)
    return _shared[0]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a response that must have `status` (never FastAPI's
    {"detail": ...})."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return dict(body["error"])


def _stop_shared() -> None:
    server = _shared.pop()
    assert server.stop() == 0

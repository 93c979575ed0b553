"""A server with small limits on the tiny model, shared by the modules that check limits,
hostile inputs and the default security settings (shared_server.py: the first module that
asks starts it, the session's end stops it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import RunningServer
from shared_server import shared_server

MODEL = "tiny"
# small, so that a test can step just past each limit cheaply
LIMITS = {"--max-n": "4", "--max-stop-strings": "2", "--max-stop-string-length": "8",
          "--max-bad-words": "2",
          "--max-request-body-bytes": "262144", "--max-logprobs": "5",
          "--max-model-len": "256", "--max-in-flight": "8"}


LimitedServer = RunningServer  # its log (level info) is kept in `log_path`


def shared_limited_server(request: pytest.FixtureRequest, model_dir: Path) -> LimitedServer:
    """The session's limited server on `model_dir`, started on first use."""
    args = [item for pair in LIMITS.items() for item in pair]
    return shared_server(request, str(model_dir), *args, "--served-model-name", MODEL,
                         "--log-level", "info", keep_log=True)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a response that must have `status` (never FastAPI's
    {"detail": ...})."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return dict(body["error"])

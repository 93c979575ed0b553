"""Servers shared by the modules that start one with the same flags. Starting one costs
seconds, so the first module that asks for a set of flags starts its server, later modules
get the same one, and the session's end stops them all (each must exit 0). A test on a
shared server reads counters as deltas and never counts on a fresh cache. (Not a conftest.py:
a second `conftest` module would shadow tests/conftest.py for `from conftest import ...`.)"""

from __future__ import annotations

import pytest
from server_harness import RunningServer

_shared: dict[tuple[tuple[str, ...], str | None, bool], RunningServer] = {}


def shared_server(request: pytest.FixtureRequest, *args: str, api_key: str | None = None,
                  keep_log: bool = False) -> RunningServer:
    """The session's `nanoserve serve *args` (with `api_key`), started on first use; with
    `keep_log` its output goes to a file, `log_path`."""
    key = (args, api_key, keep_log)
    if key not in _shared:
        if not _shared:
            request.session.addfinalizer(_stop_shared)
        log = None
        if keep_log:
            tmp_path_factory = request.getfixturevalue("tmp_path_factory")
            log = tmp_path_factory.mktemp("shared-server") / "server.log"
        _shared[key] = RunningServer(*args, api_key=api_key, log=log)
    return _shared[key]


def _stop_shared() -> None:
    exits = {}
    while _shared:
        key, server = _shared.popitem()
        exits[key] = server.stop()
    assert all(code == 0 for code in exits.values()), exits

"""Files of the llama.cpp source tree for the tests: its vocabularies and tokenizer test vectors
(`models/ggml-vocab-*.gguf`, `.inp`, `.out`), chat templates (`models/templates/*.jinja`) and
test sources (`tests/test-chat.cpp`).

The tree is the one `nanoserve bench serve` builds its llama-server from (llama-cpp-python's
pinned sdist, fetched from PyPI with pip; `llama_cpp_source`), extracted once per machine into
the user's cache and never built here. Where PyPI cannot be reached (and the tree is not cached)
the tests that need it skip; any other failure fails them.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path

import pytest

from nanoserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION, llama_cpp_source

_PYPI_PAGE = "https://pypi.org/simple/llama-cpp-python/"


def llama_cpp_file(relative_path: str) -> Path:
    """The path of a file in the llama.cpp tree (`models/ggml-vocab-gemma-4.gguf`, say),
    fetching the tree on the session's first call; skips the test if PyPI cannot be reached."""
    source, skip_reason = _source_tree()
    if source is None:
        pytest.skip(skip_reason)
    path = source / relative_path
    assert path.is_file(), f"llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s tree has no {relative_path}"
    return path


@cache
def _source_tree() -> tuple[Path | None, str]:
    """The tree, or None and why (once a session: a failed fetch is not tried again)."""
    try:
        return llama_cpp_source(), ""
    except RuntimeError as e:  # pip could not download the sdist
        if _pypi_is_reachable():
            raise
        return None, f"the llama.cpp source tree is not cached and PyPI cannot be reached ({e})"


def _pypi_is_reachable() -> bool:
    url = os.environ.get("PIP_INDEX_URL", "").rstrip("/")
    url = f"{url}/llama-cpp-python/" if url else _PYPI_PAGE
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False

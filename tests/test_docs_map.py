"""The architecture map follows the code: every file or folder `docs/design.md` and
`docs/architecture.md` name in backticks exists (a path from the repository, from `nanoserve/`
or from `nanoserve/entrypoints/`; a bare file name somewhere in the package or the tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("docs/design.md", "docs/architecture.md")
# a path with a folder in it, maybe followed by `: function`
_PATH = re.compile(r"`([A-Za-z0-9_.-]+/[A-Za-z0-9_./-]*)(?::[^`]*)?`")
_FILE = re.compile(r"`([A-Za-z0-9_]+\.(?:py|h|cpp))(?::[^`]*)?`")
_ROOTS = (REPO, REPO / "nanoserve", REPO / "nanoserve" / "entrypoints")


def _file_names() -> set[str]:
    return {p.name for folder in ("nanoserve", "tests") for p in (REPO / folder).rglob("*")
            if p.suffix in (".py", ".h", ".cpp")}


def missing_paths(text: str, file_names: set[str]) -> list[str]:
    """Each path in backticks that names nothing in the checkout, with its line."""
    missing = []
    for match in _PATH.finditer(text):
        path = match[1].rstrip("/")
        if "*" in path or path.startswith("~") or path.count("/") > 6:
            continue
        if not any((root / path).exists() for root in _ROOTS):
            missing.append(f"line {text[:match.start()].count(chr(10)) + 1}: {path}")
    for match in _FILE.finditer(text):
        if match[1] not in file_names:
            missing.append(f"line {text[:match.start()].count(chr(10)) + 1}: {match[1]}")
    return missing


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_map_names_exists(doc: str) -> None:
    assert missing_paths((REPO / doc).read_text(), _file_names()) == []


def test_a_path_that_moved_is_found() -> None:
    text = "the app (`entrypoints/openai/api_server.py: build_app`), `gone_module.py`"
    assert missing_paths(text, _file_names()) == [
        "line 1: entrypoints/openai/api_server.py", "line 1: gone_module.py"]

"""`nanoserve pull`, `list` and `rm` (entrypoints/model_commands.py), run in this process
against a registry served on loopback (tests/model/sources/registry_server.py) into a store in
a temporary folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanoserve.entrypoints.cli import main
from nanoserve.entrypoints.model_commands import human_bytes, human_time
from nanoserve.model.model_path import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "sources"))
from registry_server import RegistryServer, file_digest

NAME = "smollm2:135m"


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RegistryServer]:
    with RegistryServer() as server:
        server.add_model(NAME, default_model_path())
        monkeypatch.setenv("NANOSERVE_MODELS", str(tmp_path / "store"))
        monkeypatch.setenv("NANOSERVE_REGISTRY", server.url)
        yield server


def test_pull_list_and_rm_as_ollamas_commands(registry: RegistryServer,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", NAME]) == 0
    out, err = capsys.readouterr()
    assert out == f"pulled {NAME} (98 MB); serve it with: nanoserve serve {NAME}\n"
    assert err.splitlines()[0] == "pulling manifest" and err.splitlines()[-1] == "success"
    assert main(["list"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED", "FROM"]
    short_id = file_digest(default_model_path())[7:19]
    assert row.split()[:4] == [NAME, short_id, "98", "MB"]
    assert row.split()[4:] == ["Less", "than", "a", "second", "ago",
                               f"{registry.url}/library/smollm2:135m"]
    assert main(["rm", NAME]) == 0 and capsys.readouterr().out == f"deleted '{NAME}'\n"
    assert main(["ls"]) == 0 and len(capsys.readouterr().out.splitlines()) == 1
    assert main(["rm", NAME]) == 1
    assert capsys.readouterr().err == (f"nanoserve rm: error: model '{NAME}': is not pulled "
                                       "on this machine; `nanoserve list` shows the pulled "
                                       "models\n")
    assert main(["pull", "smollm2:7b"]) == 1
    assert "nanoserve pull: error: model 'smollm2:7b': the registry" in capsys.readouterr().err


def test_sizes_and_ages_read_as_ollama_prints_them() -> None:
    assert [human_bytes(n) for n in (512, 9_400, 98_362_432, 1_300_000_000)] == [
        "512 B", "9.4 KB", "98 MB", "1.3 GB"]
    assert [human_time(s) for s in (0.2, 1, 59, 3600, 7200, 86400 * 15)] == [
        "Less than a second ago", "About a second ago", "59 seconds ago", "About an hour ago",
        "2 hours ago", "2 weeks ago"]

"""The tuner's cache file (kernel_tuning/tune_cache.py): keyed by what a choice depends on,
written atomically with concurrent writers' entries merged, and a corrupt, foreign or stale
file ignored with one warning, then replaced."""

from __future__ import annotations

import json
import logging
import multiprocessing
from pathlib import Path

import pytest

from nanoserve.kernel_tuning.tune_cache import (
    FORMAT_VERSION,
    cache_file,
    machine_key,
    read_entries,
    write_entries,
)

KEY = machine_key(2, "build-1")


def test_the_key_names_the_cpu_its_flags_the_threads_and_the_kernels() -> None:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert KEY["cpu"] and KEY["cpu"] in cpuinfo
    assert KEY["threads"] == 2 and KEY["kernels"] == "build-1" and len(KEY["flags"]) == 16
    others = [machine_key(4, "build-1"), machine_key(2, "build-2")]
    assert len({cache_file(Path("/c"), k) for k in [KEY, *others]}) == 3


def test_entries_round_trip_and_merge(tmp_path: Path) -> None:
    path = cache_file(tmp_path / "tune", KEY)
    assert read_entries(path, KEY) == {}
    write_entries(path, KEY, {"a": {"hint": "t1"}})
    write_entries(path, KEY, {"b": {"hint": "nta"}, "a": {"hint": "t0"}})
    assert read_entries(path, KEY) == {"a": {"hint": "t0"}, "b": {"hint": "nta"}}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name,
                                                            path.with_suffix(".lock").name]


def _write_many(path: str, worker: int) -> None:
    for i in range(20):
        write_entries(Path(path), KEY, {f"w{worker}-{i}": {"n": i}})


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    """Several model servers starting at once: every entry of every writer is kept, and the
    file is whole JSON at every moment (a reader never sees a partial write)."""
    path = cache_file(tmp_path, KEY)
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(path), w)) for w in range(4)]
    for writer in writers:
        writer.start()
    seen = 0
    while any(w.is_alive() for w in writers):
        if path.exists():
            json.loads(path.read_text())  # never half written
            seen += 1
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    entries = read_entries(path, KEY)
    assert set(entries) == {f"w{w}-{i}" for w in range(4) for i in range(20)}
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "corrupt"),
    ('{"version": 1, "key": {}, "entries": []}', "corrupt"),
    (json.dumps({"version": FORMAT_VERSION + 1, "key": KEY, "entries": {}}), "of format"),
    (json.dumps({"version": FORMAT_VERSION, "key": {**KEY, "cpu": "another CPU"},
                 "entries": {"a": {"hint": "t0"}}}), "another machine"),
])
def test_an_unusable_file_is_ignored_with_one_warning_and_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, says: str) -> None:
    path = cache_file(tmp_path, KEY)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        assert read_entries(path, KEY) == {}
    assert len(caplog.records) == 1 and says in caplog.records[0].getMessage()
    write_entries(path, KEY, {"b": {"hint": "t1"}})
    assert read_entries(path, KEY) == {"b": {"hint": "t1"}}


def test_an_unwritable_directory_is_one_warning(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        write_entries(cache_file(blocked / "tune", KEY), KEY, {"a": {}})
    assert "cannot write" in caplog.text

"""The tuner's choices, kept per machine: `~/.cache/nanoserve/tune/<key>.json`.

The key is what a choice depends on: the CPU's model name and flags, the thread count and the
kernels' build (their sources, the compiler flags of every tier, torch's version). A file
holds one key's entries, each a shape class's choice (`"avx512 weights U4H 1 row dram": {...}`),
so a later start, or another model with the same classes, reads them and times nothing.

Written atomically (a temporary file renamed over the old one) under an `flock` on a lock file
beside it, re-reading the file inside the lock: the model servers of a `--models-dir` router
that start together merge their entries, none lost. A file that cannot be parsed, was written
for another key (copied from another machine) or by another version of this format is ignored
with one warning, and replaced at the next write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("nanoserve")

FORMAT_VERSION = 1


def machine_key(threads: int, kernel_build: str) -> dict[str, Any]:
    """What every entry of the file depends on (see the module)."""
    model, flags = _cpu_identity()
    return {"cpu": model, "flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[
        :16], "threads": threads, "kernels": kernel_build}


def cache_file(directory: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"{digest}.json"


def read_entries(path: Path, key: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The file's entries, or {} where there is none yet or it is unusable (one warning)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        logger.warning("kernel tuning: cannot read %s (%s); tuning again", path, e)
        return {}
    try:
        body = json.loads(text)
        if not isinstance(body, dict) or not isinstance(body.get("entries"), dict):
            raise ValueError("not a tuning file")
    except ValueError as e:
        logger.warning("kernel tuning: %s is corrupt (%s); ignored, tuning again", path, e)
        return {}
    if body.get("version") != FORMAT_VERSION:
        logger.warning("kernel tuning: %s is of format %r, not %d; ignored, tuning again",
                       path, body.get("version"), FORMAT_VERSION)
        return {}
    if body.get("key") != key:
        logger.warning("kernel tuning: %s was written for another machine or kernel build; "
                       "ignored, tuning again", path)
        return {}
    return {name: entry for name, entry in body["entries"].items() if isinstance(entry, dict)}


def write_entries(path: Path, key: dict[str, Any], entries: dict[str, dict[str, Any]]) -> None:
    """Merge `entries` into the file (theirs win), atomically and under the lock. An
    unwritable directory is one warning: the choices then last only this process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            merged = {**read_entries(path, key), **entries}
            body = {"version": FORMAT_VERSION, "key": key, "entries": merged}
            fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump(body, out, indent=1, sort_keys=True)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
    except OSError as e:
        logger.warning("kernel tuning: cannot write %s (%s); the choices last this run only",
                       path, e)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel, also if this process dies
        yield


def _cpu_identity() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (empty where there is none)."""
    model, flags = "", frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name" and not model:
            model = value.strip()
        elif name.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags

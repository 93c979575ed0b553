"""The models pulled by name, as `nanoserve list` and Ollama's `/api/tags` show them.

The store is one folder (`models_home()`), laid out as Ollama's own so that its files read the
same way, plus nanoserve's small record per pulled name:

    blobs/sha256-<hex>                          a registry's blob, kept only once checked
    blobs/sha256-<hex>-partial                  a blob being downloaded (never loaded)
    manifests/<host>/<namespace>/<model>/<tag>  a registry's manifest, as it was fetched
    pulled/<name, %-quoted>.json                what `nanoserve list` shows, one per name
    locks/                                      the store's lock, one per blob being fetched

A hub pull's record points into huggingface_hub's cache, whose files are shared with other
tools; a registry pull's points at its model blob. Every write is a rename of a whole file, so
a reader never sees half of one; `store_lock()` orders a manifest's writing and a removal's
collection of unreferenced blobs between processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from nanoserve.model.sources.local_files import write_atomically
from nanoserve.model.sources.names import parse_model_name

MODELS_HOME_ENV = "NANOSERVE_MODELS"  # read in models_home() only
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


@dataclass(frozen=True)
class PulledModel:
    """A model pulled by name: what `nanoserve list` prints and `/api/tags` lists."""

    name: str  # as the user names it later: "qwen3.5:0.8b", "hf.co/org/repo:Q8_0", "org/repo"
    source: str  # where it came from: the registry's or the hub's address, repo and revision
    path: Path  # what the loader takes: a GGUF file or a checkpoint directory
    size: int  # bytes on disk, all its files
    digest: str  # "sha256:<hex>" of its model file (Ollama's /api/tags digest)
    modified_at: float  # time.time() of the pull


def models_home() -> Path:
    """Where pulled models are recorded (and a registry's blobs kept): `$NANOSERVE_MODELS`,
    else `nanoserve/models` under `$XDG_CACHE_HOME` (`~/.cache` when unset), beside the
    kernel tuner's `~/.cache/nanoserve/tune`."""
    home = os.environ.get(MODELS_HOME_ENV)
    if home:
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "nanoserve" / "models"


def blob_path(digest: str) -> Path:
    """The blob file of `digest` ("sha256:<64 hex>"); a ValueError for any other spelling, so
    a manifest's digest can never name a path outside `blobs/`."""
    match = _DIGEST.match(digest)
    if match is None:
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return models_home() / "blobs" / f"sha256-{match[1]}"


def manifest_path(host: str, namespace: str, model: str, tag: str) -> Path:
    """Where a registry's manifest of `host/namespace/model:tag` is kept (Ollama's layout)."""
    return models_home() / "manifests" / host / namespace / model / tag


def manifest_digests(manifest: dict[str, Any]) -> list[str]:
    """The digests a manifest references: its config's and its layers'."""
    config = manifest.get("config") or {}
    found = [str(config["digest"])] if isinstance(config, dict) and "digest" in config else []
    return found + [str(layer["digest"]) for layer in manifest.get("layers") or []]


@contextlib.contextmanager
def store_lock() -> Iterator[None]:
    """The store's lock between processes and threads: held while a manifest is written and
    while a removal finds which blobs nothing references any more."""
    with _locked(models_home() / "locks" / "store.lock"):
        yield


@contextlib.contextmanager
def blob_lock(digest: str) -> Iterator[None]:
    """A lock on one blob's download, so two pulls that need it (two processes, or two names
    of one model) write its partial file one at a time and fetch it once."""
    lock = models_home() / "locks" / (blob_path(digest).name + ".lock")
    with _locked(lock):
        yield
        if blob_path(digest).exists():  # whole: no later pull writes it, so no lock is needed
            lock.unlink(missing_ok=True)


def record_pulled(model: PulledModel, *, manifest: Path | None = None) -> None:
    """Record `model` under its name (replacing an older record of it). `manifest`: the
    registry manifest it was pulled with, removed with it."""
    record: dict[str, Any] = {"name": model.name, "source": model.source,
                              "path": str(model.path), "size": model.size,
                              "digest": model.digest, "modified_at": model.modified_at}
    if manifest is not None:
        record["manifest"] = str(manifest.relative_to(models_home()))
    write_atomically(_record_path(model.name), json.dumps(record, indent=1).encode())


def find_pulled(name: str) -> PulledModel | None:
    """The record of `name` (any spelling of it: `smollm2` is `smollm2:latest`), or None."""
    record = _read_record(_record_path(canonical_name(name)))
    return None if record is None else _pulled(record)


def list_pulled() -> list[PulledModel]:
    """Every pulled model, by name."""
    folder = models_home() / "pulled"
    records = [_read_record(path) for path in sorted(folder.glob("*.json"))] \
        if folder.is_dir() else []
    return sorted((_pulled(r) for r in records if r is not None), key=lambda m: m.name)


def remove_pulled(name: str) -> bool:
    """Forget `name` and free what only it used: its manifest and every blob no other manifest
    references. A hub pull's files stay in huggingface_hub's cache, which other tools share.
    False if `name` was not pulled."""
    path = _record_path(canonical_name(name))
    with store_lock():
        record = _read_record(path)
        if record is None:
            return False
        path.unlink()  # first: from now on nobody finds it
        manifest = record.get("manifest")
        if manifest:
            _remove_manifest(models_home() / manifest)
    return True


def canonical_name(name: str) -> str:
    """The name as records are kept: `parse_model_name`'s spelling, else `name` itself."""
    parsed = parse_model_name(name)
    return name if parsed is None else str(parsed)


# --- inside the store -------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)  # released when the file closes
        yield


def _record_path(name: str) -> Path:
    return models_home() / "pulled" / (quote(name, safe="") + ".json")


def _read_record(path: Path) -> dict[str, Any] | None:
    """A record, or None if there is none (or it cannot be read: it is not trusted)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not {"name", "path"} <= record.keys():
        return None
    return record


def _pulled(record: dict[str, Any]) -> PulledModel:
    return PulledModel(name=str(record["name"]), source=str(record.get("source", "")),
                       path=Path(record["path"]), size=int(record.get("size", 0)),
                       digest=str(record.get("digest", "")),
                       modified_at=float(record.get("modified_at", 0.0)))


def _remove_manifest(manifest: Path) -> None:
    """`manifest`, then each of its blobs that no other manifest references (under the store's
    lock). Empty folders it leaves are removed up to `manifests/`."""
    try:
        digests = set(manifest_digests(json.loads(manifest.read_bytes())))
    except (OSError, ValueError):
        digests = set()
    manifest.unlink(missing_ok=True)
    root = models_home() / "manifests"
    folder = manifest.parent
    while folder != root and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    for other in root.rglob("*") if root.is_dir() else ():
        if other.is_file():
            with contextlib.suppress(OSError, ValueError):
                digests -= set(manifest_digests(json.loads(other.read_bytes())))
    for digest in digests:
        with contextlib.suppress(ValueError):
            blob_path(digest).unlink(missing_ok=True)

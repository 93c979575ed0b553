"""One LFS file of a hub repository into huggingface_hub's cache: resumed, checked, locked, its
progress told to a ProgressSink.

huggingface_hub 2.x writes a download to a temporary file of its own, unique to the process, and
deletes it when the transfer fails, so a stopped download starts again from zero; and it trusts
a blob by its name. Here its `http_get` still moves the bytes (its headers, the redirect to the
file's store, its retries within a call, each resumed by a Range request), but into
`blobs/<sha256>.incomplete`, which outlives the process and is resumed by the next one; the file
becomes `blobs/<sha256>` only once its sha256 is the one the hub lists, and a mismatch deletes
it. huggingface_hub's own lock for that blob is held throughout, so two processes asking for a
model (nanoserve's, or vLLM's beside it) download it once.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.model.sources.hub_files import RepoFile
from nanoserve.model.sources.local_files import check_room, sha256_of
from nanoserve.model.sources.progress import Progress, ProgressSink


class ChecksumMismatch(Exception):
    """A downloaded file's bytes are not those the hub lists; the file was deleted."""

    def __init__(self, path: str, algorithm: str, got: str, want: str) -> None:
        self.path, self.algorithm, self.got, self.want = path, algorithm, got, want
        super().__init__(f"{path}: {algorithm} {got}, the hub lists {want}")


@dataclass(frozen=True)
class BlobTarget:
    """Where one repository's files go in huggingface_hub's cache."""

    storage: Path  # <cache>/models--org--repo
    locks: Path  # <cache>/.locks/models--org--repo: huggingface_hub's lock files for its blobs

    def blob(self, etag: str) -> Path:
        return self.storage / "blobs" / etag


def pulling(file: RepoFile) -> str:
    """The status of a file's transfer as Ollama words it: `pulling <12 hex of its digest>`."""
    assert file.sha256 is not None
    return f"pulling {file.sha256[:12]}"


def fetch_lfs_blob(file: RepoFile, url: str, headers: dict[str, str], target: BlobTarget,
                   progress: ProgressSink) -> Path:
    """`blobs/<sha256>` of `file` (an LFS file: `sha256` and `size` known), downloaded from
    `url` (the hub's resolve URL at a commit) unless it is there; reports its progress in bytes.
    Raises ChecksumMismatch (nothing kept), OSError (ENOSPC before a byte is written when the
    disk lacks room), or huggingface_hub's and httpx2's errors (the partial file kept, to be
    resumed)."""
    from huggingface_hub.utils import WeakFileLock

    assert file.sha256 is not None and file.size is not None
    blob = target.blob(file.sha256)
    if not blob.exists():
        target.locks.mkdir(parents=True, exist_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(target.locks / f"{file.sha256}.lock"):
            if not blob.exists():  # another process may have fetched it while we waited
                _download(file, url, headers, blob, progress)
                return blob
    progress(Progress(pulling(file), f"sha256:{file.sha256}", file.size, file.size))
    return blob


def _download(file: RepoFile, url: str, headers: dict[str, str], blob: Path,
              progress: ProgressSink) -> None:
    from huggingface_hub.file_download import http_get

    assert file.sha256 is not None and file.size is not None
    partial = blob.with_name(blob.name + ".incomplete")
    done = partial.stat().st_size if partial.exists() else 0
    if done > file.size:  # not a prefix of this file: start again
        partial.unlink()
        done = 0
    check_room(blob.parent, file.size - done)
    bar = _ProgressBar.factory(progress, file)
    with partial.open("ab") as out:
        # http_get appends from `done` with a Range request (and starts over itself if the
        # server ignores the Range); it raises when fewer bytes than `size` came
        http_get(url, out, resume_size=done, headers=headers, expected_size=file.size,
                 tqdm_class=bar)
    progress(Progress("verifying sha256 digest"))
    got = sha256_of(partial)
    if got != file.sha256:
        partial.unlink()
        raise ChecksumMismatch(file.path, "sha256", got, file.sha256)
    os.replace(partial, blob)


def git_blob_sha1(path: Path) -> str:
    """The git object id of the file's bytes: what the hub lists for a file kept in git."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _ProgressBar:
    """What http_get takes for a tqdm bar (it calls the class with tqdm's keywords and uses it
    as a context manager): each chunk it writes is reported to the sink, in place of
    huggingface_hub's own bar, so there is one bar per file."""

    def __init__(self, sink: ProgressSink, file: RepoFile, initial: int = 0,
                 **_tqdm_kwargs: Any) -> None:
        assert file.size is not None and file.sha256 is not None
        self.sink, self.file, self.completed = sink, file, initial
        self.update(0)

    @classmethod
    def factory(cls, sink: ProgressSink, file: RepoFile) -> Any:
        """A callable in the place of http_get's `tqdm_class` (typed as tqdm's class there)."""
        return lambda **kwargs: cls(sink, file, **kwargs)

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def update(self, num_bytes: int) -> None:
        """num_bytes < 0 when http_get starts over (a server that ignored the Range)."""
        self.completed += num_bytes
        self.sink(Progress(pulling(self.file), f"sha256:{self.file.sha256}", self.file.size,
                           self.completed))

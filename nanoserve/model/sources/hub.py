"""A hub repository's files, fetched through `huggingface_hub` into its cache, so that they are
shared with transformers', vLLM's and llama.cpp users' own.

The repository's file list decides what is fetched (hub_files.py); huggingface_hub moves the
bytes and places them in its cache layout (`models--org--repo/{blobs,refs,snapshots}`); nanoserve
adds a progress line per file, every file checked against the hash the hub lists, a resumed and
locked transfer for the large (LFS) files (hub_download.py), answers for `HF_HUB_OFFLINE=1`
from the cache alone (and from it when the hub cannot be reached), and each failure as one line
(hub_errors.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from nanoserve.config import HubEnvironment, hub_environment
from nanoserve.model.sources.errors import ModelSourceError
from nanoserve.model.sources.hub_download import (
    BlobTarget,
    ChecksumMismatch,
    fetch_lfs_blob,
    git_blob_sha1,
)
from nanoserve.model.sources.hub_errors import explain, hub_errors, missing_gguf
from nanoserve.model.sources.hub_files import (
    SAFETENSORS_INDEX,
    RepoFile,
    checkpoint_files,
    choose_gguf,
    is_checkpoint,
)
from nanoserve.model.sources.local_files import write_atomically
from nanoserve.model.sources.names import HubName
from nanoserve.model.sources.progress import Progress, ProgressSink, no_progress

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def fetch_from_hub(name: HubName, *, token: str | None = None,
                   progress: ProgressSink = no_progress) -> Path:
    """The local path the loader takes for `name`, its files downloaded into (or found in)
    `huggingface_hub`'s cache: a safetensors checkpoint's snapshot directory, or a GGUF file
    (the first part of a split one, its other parts beside it). `token` (--hf-token) is sent
    in place of huggingface_hub's own (`HF_TOKEN`, its login). Raises ModelSourceError."""
    hub = hub_environment()
    try:
        if hub.is_offline:
            return _from_cache(name, hub, reason="HF_HUB_OFFLINE is set")
        try:
            progress(Progress("pulling manifest"))
            commit, files = _list_files(name, hub, token)
        except hub_errors() as error:
            cached = _cached_or_none(name, hub, error)
            if cached is None:
                raise
            return cached
        path = _fetch(name, commit, files, hub, token, progress)
        _remember_ref(_storage(name, hub), name.revision or "main", commit)
        progress(Progress("success"))
        return path
    except hub_errors() as error:
        raise explain(name, error, hub, token) from error


def _list_files(name: HubName, hub: HubEnvironment, token: str | None
                ) -> tuple[str, list[RepoFile]]:
    """The commit `name`'s revision is at and the repository's files there (with their sizes,
    git ids and LFS sha256s: huggingface_hub's `files_metadata`)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub.endpoint).model_info(name.repo, revision=name.revision,
                                                   files_metadata=True, token=token)
    assert info.sha is not None, "the hub names the commit of every revision"
    return info.sha, [RepoFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
                      for s in info.siblings or ()]


def _fetch(name: HubName, commit: str, files: list[RepoFile], hub: HubEnvironment,
           token: str | None, progress: ProgressSink) -> Path:
    """Download what `name` asks of `files` at `commit`; the path the loader takes."""
    if name.quant is not None or name.is_gguf or not is_checkpoint(files):
        chosen = choose_gguf(files, name.quant)
        if not chosen:
            raise missing_gguf(name, files, chosen, where=f"{hub.endpoint}/{name.repo}")
        paths = [_fetch_file(name, f, commit, hub, token, progress) for f in chosen]
        return paths[0]  # a split model's first part: its others are beside it
    wanted = checkpoint_files(files)
    small = [f for f in wanted if f.sha256 is None]
    pointers = {f.path: _fetch_file(name, f, commit, hub, token, progress) for f in small}
    shards = _index_shards(pointers.get(SAFETENSORS_INDEX))
    for f in checkpoint_files(files, shards):
        if f.path not in pointers:
            pointers[f.path] = _fetch_file(name, f, commit, hub, token, progress)
    return pointers["config.json"].parent


def _fetch_file(name: HubName, file: RepoFile, commit: str, hub: HubEnvironment,
                token: str | None, progress: ProgressSink) -> Path:
    """`file`'s path in the commit's snapshot, downloaded and checked unless it is there: an
    LFS file by hub_download (resumed, locked, its sha256 checked before it is placed), a git
    file by huggingface_hub, then its git id checked (a mismatch deletes the blob and link)."""
    from huggingface_hub import hf_hub_download, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    storage = _storage(name, hub)
    if file.sha256 is not None:
        url = hf_hub_url(name.repo, file.path, revision=commit, endpoint=hub.endpoint)
        target = BlobTarget(storage, hub.cache_dir / ".locks" / storage.name)
        fetch_lfs_blob(file, url, build_hf_headers(token=token), target, progress)
    pointer = storage / "snapshots" / commit / file.path
    is_new = not pointer.exists()
    # With the blob in place this only links it (huggingface_hub's HEAD, then the snapshot's
    # symlink under its lock); a git file it downloads, silently: the bars are ours.
    linked = Path(hf_hub_download(name.repo, file.path, revision=commit,
                                  cache_dir=hub.cache_dir, endpoint=hub.endpoint, token=token,
                                  tqdm_class=_SILENT_BAR))
    if is_new and file.sha256 is None and file.blob_id is not None:
        got = git_blob_sha1(linked)
        if got != file.blob_id:
            blob = linked.resolve()
            linked.unlink()
            blob.unlink(missing_ok=True)
            raise ChecksumMismatch(file.path, "git sha1", got, file.blob_id)
    return linked


def _index_shards(index: Path | None) -> set[str] | None:
    """The weight files a sharded checkpoint's index names; None without an index."""
    if index is None:
        return None
    return set(json.loads(index.read_text())["weight_map"].values())


def _cached_or_none(name: HubName, hub: HubEnvironment, error: BaseException) -> Path | None:
    """The cached copy of `name` when the hub cannot be reached (as huggingface_hub serves its
    cache then); None when the error is another, or nothing whole is cached."""
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    if not isinstance(error, httpx2.ConnectError | httpx2.TimeoutException | OfflineModeIsEnabled):
        return None
    try:
        return _from_cache(name, hub, reason="the hub cannot be reached")
    except ModelSourceError:
        return None


def _from_cache(name: HubName, hub: HubEnvironment, *, reason: str) -> Path:
    """`name` as the cache holds it, choosing among the files its snapshot has by the same
    rules; ModelSourceError naming what is missing, and `reason` (offline), otherwise."""
    storage = _storage(name, hub)
    revision = name.revision or "main"
    ref = storage / "refs" / revision
    commit = revision if _COMMIT.match(revision) else (
        ref.read_text().strip() if ref.is_file() else None)
    snapshot = storage / "snapshots" / (commit or "-")
    if commit is None or not snapshot.is_dir():
        raise ModelSourceError(
            str(name), f"{reason} and nothing of {name.repo} (revision {revision}) is in the "
            f"cache {hub.cache_dir}", _ONLINE_FIX)
    files = [RepoFile(p.relative_to(snapshot).as_posix()) for p in sorted(snapshot.rglob("*"))
             if p.is_file()]  # a broken link (its blob deleted) is no file
    if name.quant is not None or name.is_gguf or not is_checkpoint(files):
        chosen = choose_gguf(files, name.quant)
        if not chosen:
            raise missing_gguf(name, files, chosen, where=f"the cache ({reason})")
        return snapshot / chosen[0].path
    shards = _index_shards(snapshot / SAFETENSORS_INDEX
                           if (snapshot / SAFETENSORS_INDEX).is_file() else None)
    missing = sorted((shards or set()) - {f.path for f in files})
    if missing:
        raise ModelSourceError(str(name), f"{reason} and the cache lacks {', '.join(missing)} "
                               f"of {name.repo}", _ONLINE_FIX)
    return snapshot


_ONLINE_FIX = "unset HF_HUB_OFFLINE (or restore the network) to download it"


def _storage(name: HubName, hub: HubEnvironment) -> Path:
    """The repository's folder in the cache: huggingface_hub's `models--org--repo`."""
    from huggingface_hub.file_download import repo_folder_name

    return hub.cache_dir / repo_folder_name(repo_id=name.repo, repo_type="model")


def _remember_ref(storage: Path, revision: str, commit: str) -> None:
    """`refs/<revision>` → `commit`, as huggingface_hub writes it, once every file is here: the
    cache (and HF_HUB_OFFLINE) finds the revision by it, never at a commit half fetched."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    if ref.is_file() and ref.read_text() == commit:
        return
    write_atomically(ref, commit.encode())  # a reader never sees half a ref


class _SilentBar:
    """huggingface_hub's bar for a git file, drawn by no one."""

    def __init__(self, **_kwargs: Any) -> None:
        pass

    def __enter__(self) -> _SilentBar:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def update(self, _num_bytes: int) -> None:
        pass


_SILENT_BAR: Any = _SilentBar

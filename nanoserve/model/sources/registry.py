"""Models from an OCI registry that speaks Ollama's manifest format (`ollama pull qwen3.5:0.8b`).

    GET {registry}/v2/{namespace}/{model}/manifests/{tag}   the manifest (Docker's v2 schema)
    GET {registry}/v2/{namespace}/{model}/blobs/{digest}    each layer, and the config blob

The layer `application/vnd.ollama.image.model` is the GGUF file the loader takes; the others
(`.template`, a Go template; `.params`, `.license`, `.system`) are kept beside it as Ollama keeps
them. The chat template nanoserve uses is the GGUF's own `tokenizer.chat_template`.

A blob is written to `sha256-<hex>-partial`, resumed from its end with a Range request, hashed
as it arrives, and renamed to its final name only once its sha256 equals its digest (a
mismatch deletes it); the manifest and the record are written last, so a failed pull leaves
nothing a later start would load. Progress events are Ollama's pull's own.

The registry is `$NANOSERVE_REGISTRY` (default Ollama's, https), or the host a name spells
(`127.0.0.1:5000/library/smollm2:135m`). Plain http is allowed to a loopback host only, the
rule Docker applies to registries by default: a manifest names the blobs that are checked, so
the manifest itself must come over TLS from any other machine.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from nanoserve.model.sources.errors import ModelNotFoundError, ModelSourceError
from nanoserve.model.sources.local_files import check_room, sha256_of, write_atomically
from nanoserve.model.sources.names import RegistryName
from nanoserve.model.sources.progress import Progress, ProgressSink, no_progress
from nanoserve.model.sources.store import (
    PulledModel,
    blob_lock,
    blob_path,
    manifest_path,
    models_home,
    record_pulled,
    store_lock,
)

REGISTRY_ENV = "NANOSERVE_REGISTRY"  # read in registry_address() only
DEFAULT_REGISTRY = "https://registry.ollama.ai"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
MODEL_LAYER = "application/vnd.ollama.image.model"
_CHUNK = 1 << 20
_MAX_MANIFEST_BYTES = 4 << 20
_TIMEOUT = httpx.Timeout(60.0, connect=10.0)


@dataclass(frozen=True)
class _Layer:
    digest: str  # "sha256:<hex>"
    size: int
    media_type: str


def registry_address(name: RegistryName) -> str:
    """The registry `name` is pulled from, as a URL without a trailing slash. Raises
    ModelSourceError for a scheme other than https (http: loopback only)."""
    if name.host is not None:
        scheme = "http" if is_loopback(name.host.split(":")[0]) else "https"
        return f"{scheme}://{name.host}"
    url = (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ModelSourceError(str(name), f"{REGISTRY_ENV}={url!r} is not an http(s) URL",
                               f"set it to a registry's address, e.g. {DEFAULT_REGISTRY}")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ModelSourceError(str(name), f"{REGISTRY_ENV}={url!r} is plain http to another "
                               "machine", "use https (plain http is for a registry on this "
                               "machine only: 127.0.0.1, ::1, localhost)")
    return url


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine: `localhost` or a loopback address."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def pull_from_registry(name: RegistryName, *,
                       progress: ProgressSink = no_progress) -> PulledModel:
    """Pull `name`'s manifest and blobs into the store, each blob's sha256 checked, a partial
    blob resumed; returns the recorded model. Raises ModelSourceError naming the model, the
    cause and the fix. `progress` hears of every MiB (a sink shows what it needs of them); an
    exception it raises stops the pull, the partial blob kept for the next pull to resume."""
    model = str(name)
    base = registry_address(name)
    repo = f"{base}/v2/{name.namespace}/{name.model}"
    headers = {"User-Agent": "nanoserve"}  # no version: `nanoserve` imports this module
    try:
        with httpx.Client(follow_redirects=True, timeout=_TIMEOUT, headers=headers) as client:
            progress(Progress("pulling manifest"))
            raw = _fetch_manifest(client, f"{repo}/manifests/{name.tag}", model, base, name)
            layers, model_layer = _read_manifest(raw, model)
            kept = [layer for layer in layers if blob_path(layer.digest).exists()]
            for layer in layers:
                _fetch_blob(client, f"{repo}/blobs/{layer.digest}", layer, model, progress)
        progress(Progress("verifying sha256 digest"))
        for layer in kept:  # the new ones were hashed as they arrived
            _verify_kept(layer, model)
        progress(Progress("writing manifest"))
        host = urlsplit(base).netloc
        pulled = PulledModel(name=model, source=f"{base}/{name.namespace}/{name.model}:"
                             f"{name.tag}", path=blob_path(model_layer.digest),
                             size=sum(layer.size for layer in layers),
                             digest=model_layer.digest, modified_at=time.time())
        _write_manifest(manifest_path(host, name.namespace, name.model, name.tag), raw,
                        layers, pulled)
    except OSError as e:
        raise _disk_error(model, e) from e
    progress(Progress("success"))
    return pulled


def _fetch_manifest(client: httpx.Client, url: str, model: str, base: str,
                    name: RegistryName) -> bytes:
    try:
        with client.stream("GET", url, headers={"Accept": MANIFEST_TYPE}) as response:
            if response.status_code == 404:
                raise ModelNotFoundError(
                    model, f"the registry {base} has no model {name.namespace}/{name.model} "
                    f"with the tag {name.tag!r}", "check the name and the tag (Ollama's "
                    "library lists them: https://ollama.com/library)")
            _check_status(response, model, "the manifest")
            raw = b""
            for chunk in response.iter_bytes():
                raw += chunk
                if len(raw) > _MAX_MANIFEST_BYTES:
                    raise ModelSourceError(model, f"the manifest at {url} is over "
                                           f"{_MAX_MANIFEST_BYTES} bytes: not a model's")
            return raw
    except httpx.TransportError as e:
        raise _network_error(model, base, e) from e


def _read_manifest(raw: bytes, model: str) -> tuple[list[_Layer], _Layer]:
    """The blobs to fetch (the layers, then the config) and the model layer among them."""
    try:
        manifest = json.loads(raw)
        entries: list[dict[str, Any]] = list(manifest.get("layers") or [])
        if isinstance(manifest.get("config"), dict):
            entries.append(manifest["config"])
        layers = [_Layer(str(e["digest"]), int(e["size"]), str(e.get("mediaType", "")))
                  for e in entries]
        for layer in layers:
            blob_path(layer.digest)  # a ValueError unless it is "sha256:<64 hex>"
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ModelSourceError(model, f"the registry's manifest cannot be read ({e})",
                               "the registry must speak Ollama's manifest format") from e
    models = [layer for layer in layers if layer.media_type == MODEL_LAYER]
    if not models:
        raise ModelSourceError(model, f"the manifest has no model layer ({MODEL_LAYER})",
                               "it is not an Ollama model; pull an Ollama model's name")
    return layers, models[0]


def _fetch_blob(client: httpx.Client, url: str, layer: _Layer, model: str,
                progress: ProgressSink) -> None:
    """`layer`'s blob into the store, resumed from its partial file and checked."""
    final = blob_path(layer.digest)
    partial = final.with_name(final.name + "-partial")
    status = f"pulling {layer.digest[7:19]}"
    with blob_lock(layer.digest):  # another pull may have fetched it while we waited
        if final.exists():
            progress(Progress(status, layer.digest, layer.size, layer.size))
            return
        hasher = hashlib.sha256()
        done = _hash_partial(partial, layer.size, hasher)
        _check_space(model, layer.size - done, final.parent)
        progress(Progress(status, layer.digest, layer.size, done))
        headers = {"Range": f"bytes={done}-"} if done else {}
        try:
            with client.stream("GET", url, headers=headers) as response:
                _check_status(response, model, f"the blob {layer.digest}")
                if done and response.status_code != 206:  # the range was ignored: restart
                    hasher, done = hashlib.sha256(), 0
                with open(partial, "ab" if done else "wb") as file:
                    for chunk in response.iter_bytes(_CHUNK):
                        file.write(chunk)
                        hasher.update(chunk)
                        done += len(chunk)
                        if done > layer.size:
                            break
                        # each chunk: a sink that raises stops the pull within a MiB
                        progress(Progress(status, layer.digest, layer.size, done))
        except httpx.TransportError as e:
            if done == 0 and isinstance(e, httpx.ConnectError):
                raise _network_error(model, urlsplit(url).netloc, e) from e
            raise ModelSourceError(model, f"the transfer of {layer.digest[7:19]} was cut at "
                                   f"{done} of {layer.size} bytes ({type(e).__name__}: {e})",
                                   "pull again: it resumes where it stopped") from e
        _finish_blob(partial, final, layer, hasher.hexdigest(), done, model)
        progress(Progress(status, layer.digest, layer.size, layer.size))


def _hash_partial(partial: Path, size: int, hasher: Any) -> int:
    """The bytes of an earlier pull's partial file, fed to `hasher` (resumed from its end);
    0 where there is none, or it is longer than the blob (then it is started again)."""
    if not partial.exists() or partial.stat().st_size > size:
        return 0
    with open(partial, "rb") as file:
        while chunk := file.read(_CHUNK):
            hasher.update(chunk)
    return partial.stat().st_size


def _finish_blob(partial: Path, final: Path, layer: _Layer, hex_digest: str, done: int,
                 model: str) -> None:
    """The partial file renamed to its blob's name if it is whole and its sha256 is the
    digest; otherwise a ModelSourceError (a file of the wrong hash is deleted)."""
    if done < layer.size:
        raise ModelSourceError(model, f"the transfer of {layer.digest[7:19]} ended at {done} "
                               f"of {layer.size} bytes", "pull again: it resumes where it "
                               "stopped")
    if done > layer.size or f"sha256:{hex_digest}" != layer.digest:
        partial.unlink(missing_ok=True)
        raise ModelSourceError(model, f"the blob {layer.digest} failed its sha256 check "
                               f"({done} bytes hashed to sha256:{hex_digest}); the download "
                               "was deleted", "pull again; if it fails again, the registry "
                               "serves a damaged file")
    os.replace(partial, final)


def _verify_kept(layer: _Layer, model: str) -> None:
    """A blob kept from an earlier pull hashed again (Ollama's pull does too); a damaged one
    is deleted and the pull fails, so the next one fetches it again."""
    path = blob_path(layer.digest)
    if f"sha256:{sha256_of(path)}" != layer.digest:
        path.unlink(missing_ok=True)
        raise ModelSourceError(model, f"the kept blob {layer.digest} was damaged on disk "
                               "(sha256 mismatch) and is deleted", "pull again to fetch it")


def _write_manifest(path: Path, raw: bytes, layers: list[_Layer], pulled: PulledModel) -> None:
    """The manifest and the record, once every blob is in place (under the store's lock, so a
    removal that runs meanwhile cannot take a blob this manifest needs)."""
    with store_lock():
        missing = [layer.digest for layer in layers if not blob_path(layer.digest).exists()]
        if missing:
            raise ModelSourceError(pulled.name, f"blobs were removed while it was pulled "
                                   f"({', '.join(missing)})", "pull again")
        write_atomically(path, raw)
        record_pulled(pulled, manifest=path)


def _check_status(response: httpx.Response, model: str, what: str) -> None:
    if response.status_code in (401, 403):
        raise ModelSourceError(model, f"the registry refused {what} (HTTP "
                               f"{response.status_code}: a private model, or one that needs "
                               "a login)", "nanoserve pulls public models only; check the name")
    if response.status_code >= 400:
        raise ModelSourceError(model, f"the registry answered HTTP {response.status_code} for "
                               f"{what} ({response.url})", "try again later, or check "
                               f"{REGISTRY_ENV}")


def _check_space(model: str, needed: int, folder: Path) -> None:
    try:
        check_room(folder, needed)
    except OSError as e:
        raise _disk_error(model, e) from None


def _network_error(model: str, base: str, e: Exception) -> ModelSourceError:
    return ModelSourceError(model, f"cannot reach the registry {base} ({type(e).__name__}: "
                            f"{e})", "check the network, or set NANOSERVE_REGISTRY to a "
                            "registry this machine can reach")


def _disk_error(model: str, e: OSError) -> ModelSourceError:
    if e.errno == errno.ENOSPC:
        return ModelSourceError(model, f"no space left on the disk of "
                                f"{e.filename or models_home()} ({e.strerror})",
                                "free space there, or set NANOSERVE_MODELS to a folder on a "
                                "larger disk; pull again to resume")
    return ModelSourceError(model, f"cannot write the store ({e})", "check the permissions "
                            "of NANOSERVE_MODELS's folder")

"""A Hugging Face hub served on loopback, speaking what `huggingface_hub` calls: the tests point
`HF_ENDPOINT` at it, and the real client downloads from it (nothing reaches a real hub).

    with serve_hub({"org/model-GGUF": {"model-Q8_0.gguf": path}}, gated={"org/gated"}) as hub:
        env = {"HF_ENDPOINT": hub.url}          # a server subprocess's environment
        hub.add_repo("org/tiny", checkpoint_repo_files(tiny_dir))   # more repos, any time
        hub.num_gets("org/model-GGUF", "model-Q8_0.gguf")           # bodies served

Endpoints, as the real hub answers them:
- `GET /api/models/{repo}[/revision/{rev}]`: the commit (`sha`) and `siblings`; with `blobs=true`
  each file's size, git id and LFS sha256.
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: a git file's bytes with its `ETag` (git id) and
  `X-Repo-Commit`; an LFS file (.gguf, .safetensors, .bin, or over 10 MiB) is a 302 to a second
  server, the "CDN", with `X-Linked-Etag` (its sha256) and `X-Linked-Size`; the CDN serves
  Range requests (206 + Content-Range), as the resolve route does for git files.
- errors in the hub's headers: 404 `X-Error-Code: RepoNotFound` / `RevisionNotFound` /
  `EntryNotFound`; 401 `GatedRepo` for a gated repository's files without
  `Authorization: Bearer <hub.token>` (its model info is public, as on the hub).
Hooks: `cut_next_get` (a transfer stops halfway, the connection closed), `corrupt_next_get` (a
byte flipped), `hold_gets` (bodies wait for an event), and a log of every request. Files given
as paths are streamed from disk; each one's sha256 is computed once per test session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

TOKEN = "hf_nanoserve_test_token"  # the one token the hub accepts for a gated repository
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
LFS_MIN_SIZE = 10 << 20
_CHUNK = 1 << 20
_SHA256_OF_PATH: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) → sha256


@dataclass(frozen=True)
class HubFile:
    """One file of a repository: its bytes (in memory or a path to stream) and its ids."""

    path: str
    source: bytes | Path
    size: int
    blob_id: str  # git sha1 of the bytes, or of the LFS pointer
    sha256: str | None  # an LFS file's

    @classmethod
    def of(cls, path: str, source: bytes | Path) -> HubFile:
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        if not (path.endswith(LFS_SUFFIXES) or size > LFS_MIN_SIZE):
            data = source if isinstance(source, bytes) else source.read_bytes()
            return cls(path, source, size, _git_id(data), None)
        sha256 = _sha256(source)
        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                   f"size {size}\n").encode()
        return cls(path, source, size, _git_id(pointer), sha256)


@dataclass(frozen=True)
class HubRequest:
    """A request either server saw."""

    method: str
    server: str  # "hub" or "cdn"
    path: str  # the URL's path, unquoted
    range: str | None
    repo: str | None = None  # for the routes of a file: its repository and path in it
    file: str | None = None


@dataclass
class _Repo:
    revisions: dict[str, tuple[str, dict[str, HubFile]]]  # branch → (commit, files by path)
    is_gated: bool = False

    def at(self, revision: str) -> tuple[str, dict[str, HubFile]] | None:
        """A branch's commit and files, or a commit's own."""
        if revision in self.revisions:
            return self.revisions[revision]
        return next((rev for rev in self.revisions.values() if rev[0] == revision), None)


@dataclass
class LocalHub:
    """The running hub: its endpoint (`url`, what `HF_ENDPOINT` names), its repositories, the
    hooks and the log. Made by `start_hub` / `serve_hub`."""

    url: str = ""
    cdn_url: str = ""
    token: str = TOKEN
    requests: list[HubRequest] = field(default_factory=list)
    repos: dict[str, _Repo] = field(default_factory=dict)
    _cuts: dict[tuple[str, str], int | None] = field(default_factory=dict)
    _corruptions: dict[tuple[str, str], int | None] = field(default_factory=dict)
    _holds: dict[tuple[str, str], threading.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _servers: list[ThreadingHTTPServer] = field(default_factory=list)

    def add_repo(self, repo: str, files: Mapping[str, bytes | Path], *,
                 revision: str = "main", is_gated: bool = False) -> str:
        """Add (or replace) branch `revision` of `repo` holding `files` ({path: bytes or a
        file's path}); returns its commit. `is_gated` applies to the whole repository."""
        hub_files = {path: HubFile.of(path, source) for path, source in files.items()}
        listing = "".join(f"{path} {f.blob_id}\n" for path, f in sorted(hub_files.items()))
        commit = hashlib.sha1(f"{repo}@{revision}\n{listing}".encode()).hexdigest()
        with self._lock:
            entry = self.repos.setdefault(repo, _Repo({}))
            entry.revisions[revision] = (commit, dict(sorted(hub_files.items())))
            entry.is_gated = entry.is_gated or is_gated
        return commit

    def file(self, repo: str, path: str, revision: str = "main") -> HubFile:
        return self.repos[repo].revisions[revision][1][path]

    def cut_next_get(self, repo: str, path: str, at: int | None = None) -> None:
        """The next GET of the file's bytes stops after byte `at` of the file (half of it by
        default) and the connection is closed, as a dropped network would."""
        self._cuts[(repo, path)] = at

    def corrupt_next_get(self, repo: str, path: str, at: int | None = None) -> None:
        """The next GET of the file's bytes has its byte `at` (the middle by default) flipped."""
        self._corruptions[(repo, path)] = at

    def hold_gets(self, repo: str, path: str) -> threading.Event:
        """GETs of the file's bytes wait (up to 60 s) until the returned event is set."""
        event = self._holds[(repo, path)] = threading.Event()
        return event

    def gets(self, repo: str, path: str) -> list[HubRequest]:
        """The GETs of the file's bytes served so far (a git file's resolve, an LFS file's CDN
        URL; a redirect is not counted)."""
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and (r.repo, r.file)
                    == (repo, path) and (r.server == "cdn" or self.file_is_git(repo, path))]

    def num_gets(self, repo: str, path: str) -> int:
        return len(self.gets(repo, path))

    def ranges(self, repo: str, path: str) -> list[str]:
        """The Range headers of those GETs (a resumed transfer sends one)."""
        return [r.range for r in self.gets(repo, path) if r.range is not None]

    def clear_log(self) -> None:
        """Forget the requests seen so far (the counts start again)."""
        with self._lock:
            self.requests.clear()

    def file_is_git(self, repo: str, path: str) -> bool:
        return all(files[path].sha256 is None for _, files in self.repos[repo].revisions.values()
                   if path in files)

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


def start_hub(repos: Mapping[str, Mapping[str, bytes | Path]] | None = None, *,
              gated: set[str] | frozenset[str] = frozenset()) -> LocalHub:
    """A hub on two free loopback ports (the hub, its CDN), serving from threads until
    `close()`; `repos` as `add_repo` takes them, those named in `gated` gated."""
    hub = LocalHub()
    for repo, files in (repos or {}).items():
        hub.add_repo(repo, files, is_gated=repo in gated)
    for server_name in ("hub", "cdn"):
        handler = type(f"{server_name}Handler", (_Handler,),
                       {"hub": hub, "server_name": server_name})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        hub._servers.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        if server_name == "hub":
            hub.url = url
        else:
            hub.cdn_url = url
    return hub


@contextlib.contextmanager
def serve_hub(repos: Mapping[str, Mapping[str, bytes | Path]] | None = None, *,
              gated: set[str] | frozenset[str] = frozenset()) -> Iterator[LocalHub]:
    """`start_hub` for the length of a `with` block."""
    hub = start_hub(repos, gated=gated)
    try:
        yield hub
    finally:
        hub.close()


def checkpoint_repo_files(directory: Path) -> dict[str, Path]:
    """Every file under `directory` (a checkpoint written by save_pretrained) by its path."""
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*"))
            if p.is_file()}


def gguf_repo_files(gguf: Path, stem: str, quants: tuple[str, ...] = ("Q4_K_M", "Q8_0"),
                    split_dir: Path | None = None, split_parts: int = 3) -> dict[str, Path]:
    """A GGUF repository's files: `gguf` under each of `quants`' names (`<stem>-Q8_0.gguf`:
    the same bytes, named only), and, given a `split_dir` to write them in, the same model
    split into `split_parts` parts by llama.cpp's rule (tests/gguf_split_files.py), named by
    the file's own quant (`<stem>-Q4_1-00001-of-00003.gguf` for the default model)."""
    files: dict[str, Path] = {f"{stem}-{quant}.gguf": gguf for quant in quants}
    if split_dir is not None:
        from gguf_split_files import split_gguf

        quant = gguf.stem.rsplit("-", 1)[-1].rsplit(".", 1)[-1].upper()
        for part in split_gguf(gguf, split_dir, split_parts, stem=f"{stem}-{quant}"):
            files[part.name] = part
    return files


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx2 uses it
    hub: LocalHub
    server_name: str

    def log_message(self, *_args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        range_header = self.headers.get("Range")
        if self.server_name == "cdn":
            match = re.match(r"^/cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)$", path)
            self._log(path, range_header, match and match[1], match and match[3])
            if match is None:
                return self._error(404, "EntryNotFound")
            return self._serve_file(match[1], match[2], match[3])
        if match := re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?$", path):
            self._log(path, range_header)
            return self._model_info(match[1], match[2] or "main", query.get("blobs") == ["true"])
        if match := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
            self._log(path, range_header, match[1], match[3])
            return self._resolve(match[1], match[2], match[3])
        self._log(path, range_header)
        self._error(404, "EntryNotFound")

    def _log(self, path: str, range_header: str | None, repo: str | None = None,
             file: str | None = None) -> None:
        with self.hub._lock:
            self.hub.requests.append(HubRequest(self.command, self.server_name, path,
                                                range_header, repo, file))

    def _model_info(self, repo: str, revision: str, with_blobs: bool) -> None:
        found = self._revision(repo, revision)
        if found is None:
            return
        commit, files = found
        siblings = [_sibling(f, with_blobs) for f in files.values()]
        gated = "manual" if self.hub.repos[repo].is_gated else False
        body = json.dumps({"_id": commit[:24], "id": repo, "modelId": repo, "sha": commit,
                           "private": False, "gated": gated, "disabled": False,
                           "downloads": 0, "likes": 0, "tags": [], "siblings": siblings})
        self._send(200, {"Content-Type": "application/json"}, body.encode())

    def _resolve(self, repo: str, revision: str, path: str) -> None:
        found = self._revision(repo, revision)
        if found is None:
            return
        commit, files = found
        if self.hub.repos[repo].is_gated and (self.headers.get("Authorization")
                                              != f"Bearer {self.hub.token}"):
            return self._error(401, "GatedRepo", f"Access to model {repo} is restricted. You "
                               "must have access to it and be authenticated to access it.")
        hub_file = files.get(path)
        if hub_file is None:
            return self._error(404, "EntryNotFound", commit=commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hub_file.sha256 or hub_file.blob_id}"'}
        if hub_file.sha256 is None:
            return self._serve_file(repo, commit, path, headers)
        location = f"{self.hub.cdn_url}/cdn/{repo}/{commit}/{quote(path)}"
        self._send(302, headers | {"Location": location, "X-Linked-Etag": f'"{hub_file.sha256}"',
                                   "X-Linked-Size": str(hub_file.size)}, b"")

    def _revision(self, repo: str, revision: str) -> tuple[str, dict[str, HubFile]] | None:
        """The revision's commit and files, or None with the hub's 404 sent."""
        if repo not in self.hub.repos:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        found = self.hub.repos[repo].at(revision)
        if found is None:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
        return found

    def _serve_file(self, repo: str, commit: str, path: str,
                    headers: dict[str, str] | None = None) -> None:
        found = self.hub.repos.get(repo)
        files = found.at(commit) if found else None
        hub_file = files[1].get(path) if files else None
        if hub_file is None:
            return self._error(404, "EntryNotFound")
        start, end = 0, hub_file.size  # [start, end)
        headers = (headers or {}) | {"Accept-Ranges": "bytes",
                                     "Content-Type": "application/octet-stream"}
        status = 200
        if match := re.match(r"^bytes=(\d+)-(\d*)$", self.headers.get("Range") or ""):
            start, end = int(match[1]), min(int(match[2] or hub_file.size - 1) + 1, end)
            if start >= hub_file.size:
                return self._send(416, {"Content-Range": f"bytes */{hub_file.size}"}, b"")
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{hub_file.size}"
        headers["Content-Length"] = str(end - start)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            self._stream(repo, hub_file, start, end)

    def _stream(self, repo: str, hub_file: HubFile, start: int, end: int) -> None:
        """Bytes [start, end) of the file, after its hold, with its one-shot hooks."""
        key = (repo, hub_file.path)
        hold = self.hub._holds.get(key)
        if hold is not None:
            hold.wait(60)
        cut = self._take(self.hub._cuts, key, hub_file.size)
        flip = self._take(self.hub._corruptions, key, hub_file.size)
        if 0 <= cut < end:
            end = max(cut, start)
            self.close_connection = True  # fewer bytes than Content-Length, then EOF
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for offset, chunk in _chunks(hub_file.source, start, end):
                if offset <= flip < offset + len(chunk):
                    at = flip - offset
                    chunk = chunk[:at] + bytes([chunk[at] ^ 0xFF]) + chunk[at + 1:]
                self.wfile.write(chunk)

    def _take(self, hooks: dict[tuple[str, str], int | None], key: tuple[str, str],
              size: int) -> int:
        """The byte a one-shot hook names for this GET, the hook then spent; -1: none."""
        with self.hub._lock:
            if key not in hooks:
                return -1
            at = hooks.pop(key)
        return size // 2 if at is None else at

    def _error(self, status: int, code: str, message: str = "", commit: str = "") -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        body = json.dumps({"error": message or code}).encode()
        self._send(status, headers | ({"X-Repo-Commit": commit} if commit else {}), body)

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _sibling(f: HubFile, with_blobs: bool) -> dict[str, Any]:
    """A file as the model info lists it; with its ids and sizes when `blobs=true` was asked."""
    if not with_blobs:
        return {"rfilename": f.path}
    lfs = {"lfs": {"size": f.size, "sha256": f.sha256, "pointerSize": 134}} if f.sha256 else {}
    return {"rfilename": f.path, "size": f.size, "blobId": f.blob_id} | lfs


def _chunks(source: bytes | Path, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of [start, end) of the source, read from disk as they go."""
    if isinstance(source, bytes):
        for offset in range(start, end, _CHUNK):
            yield offset, source[offset:min(offset + _CHUNK, end)]
        return
    with source.open("rb") as f:
        f.seek(start)
        for offset in range(start, end, _CHUNK):
            yield offset, f.read(min(_CHUNK, end - offset))


def _git_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sha256(source: bytes | Path) -> str:
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    stat = source.stat()
    key = (str(source.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256_OF_PATH:
        with source.open("rb") as f:
            _SHA256_OF_PATH[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _SHA256_OF_PATH[key]

"""An OCI registry in Ollama's manifest format, served on loopback by the tests: a real HTTP
server in a thread, the endpoints `ollama pull` (and nanoserve's registry.py) call.

    GET /v2/                                   200 (the API's version check)
    GET|HEAD /v2/<ns>/<model>/manifests/<tag>  the manifest; 404 MANIFEST_UNKNOWN
    GET|HEAD /v2/<ns>/<model>/blobs/<digest>   the blob, whole (200) or a Range (206)

A model's GGUF file is streamed from disk (the real default model's ~100 MB, never copied);
its other layers (template, params, license, system) and the config blob are held in memory.
Hooks a test sets on one blob: `cut` (the next transfer stops halfway, the connection closed),
`corrupt` (a byte served flipped, until `repair`), `hold` (the next transfer waits at a byte
until the event is set). `requests` records what was asked, with each Range header.

    with RegistryServer() as registry:
        registry.add_model("smollm2:135m", default_model_path())
        os.environ["NANOSERVE_REGISTRY"] = registry.url
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
LAYER_TYPE = "application/vnd.ollama.image."
_PATH = re.compile(r"^/v2/(.+)/(manifests|blobs)/([^/]+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 20
# SmolLM2's chat template as Ollama's library writes it (Go text/template), for the layer
DEFAULT_TEMPLATE = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
                    "{{ end }}<|im_start|>assistant\n")


@functools.cache
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()


def file_digest(path: Path) -> str:
    """`path`'s "sha256:<hex>", hashed once per session (per size and modification time)."""
    stat = path.stat()
    return _file_digest(path.resolve(), stat.st_size, stat.st_mtime_ns)


@dataclass
class Blob:
    digest: str
    size: int
    data: bytes | None = None  # held in memory, or
    path: Path | None = None  # streamed from this file

    def read(self, start: int, length: int) -> bytes:
        if self.data is not None:
            return self.data[start:start + length]
        assert self.path is not None
        with open(self.path, "rb") as file:
            file.seek(start)
            return file.read(length)


@dataclass
class Hooks:
    """What a blob's transfers do differently (see the module)."""

    cut_at: int | None = None  # the next transfer stops at this byte of the blob
    corrupt_at: int | None = None  # this byte is served flipped
    hold_at: int | None = None  # the next transfer waits here for `released`
    released: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)  # set once it waits


class RegistryServer:
    """The registry (see the module). `add_model` before pulling; `close` (or `with`) stops
    it."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], bytes] = {}  # (ns/model, tag) -> manifest
        self.blobs: dict[str, Blob] = {}
        self.hooks: dict[str, Hooks] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range
        self.require_login = False  # every answer a 401, as to a private model
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"registry": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="test-registry")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> RegistryServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for hooks in self.hooks.values():
            hooks.released.set()
        self._server.shutdown()
        self._server.server_close()

    def add_model(self, name: str, gguf: Path, *, template: str = DEFAULT_TEMPLATE,
                  params: dict[str, Any] | None = None, system: str | None = None,
                  license: str | None = "Apache License 2.0") -> str:
        """Serve `gguf` as `name` ("model:tag" in the library, or "ns/model:tag"), with the
        layers Ollama's library gives a model; returns the model layer's digest."""
        repo, _, tag = name.partition(":")
        repo = repo if "/" in repo else f"library/{repo}"
        model = Blob(file_digest(gguf), gguf.stat().st_size, path=gguf)
        layers = [("model", model)]
        texts = {"template": template, "license": license, "system": system,
                 "params": json.dumps(params or {"stop": ["<|im_end|>"]})}
        layers += [(kind, self._text_blob(text)) for kind, text in texts.items()
                   if text is not None]
        config = self._text_blob(json.dumps({
            "model_format": "gguf", "model_family": "llama", "model_type": "135M",
            "file_type": "Q4_1", "architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [b.digest for _, b in layers]}}))
        self.blobs[model.digest] = model
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                               "digest": config.digest, "size": config.size},
                    "layers": [{"mediaType": LAYER_TYPE + kind, "digest": blob.digest,
                                "size": blob.size} for kind, blob in layers]}
        self.manifests[(repo, tag or "latest")] = json.dumps(manifest, indent=3).encode()
        return model.digest

    def cut(self, digest: str, at: int) -> None:
        """The next transfer of `digest` stops after byte `at` of the blob, its connection
        closed (the Content-Length it announced unmet)."""
        self.hooks.setdefault(digest, Hooks()).cut_at = at

    def corrupt(self, digest: str, at: int) -> None:
        """Byte `at` of `digest` is served flipped until `repair`."""
        self.hooks.setdefault(digest, Hooks()).corrupt_at = at

    def repair(self, digest: str) -> None:
        self.hooks.setdefault(digest, Hooks()).corrupt_at = None

    def hold(self, digest: str, at: int) -> Hooks:
        """The next transfer of `digest` waits at byte `at` until `hooks.released` is set
        (`hooks.held` is set once it waits)."""
        hooks = self.hooks.setdefault(digest, Hooks())
        hooks.hold_at, hooks.released, hooks.held = at, threading.Event(), threading.Event()
        return hooks

    def blob_gets(self, digest: str) -> list[str | None]:
        """The Range header of each GET of `digest` so far (None: the whole blob)."""
        return [rng for method, path, rng in self.requests
                if method == "GET" and path.endswith(f"/blobs/{digest}")]

    def _text_blob(self, text: str) -> Blob:
        data = text.encode()
        blob = Blob("sha256:" + hashlib.sha256(data).hexdigest(), len(data), data=data)
        self.blobs[blob.digest] = blob
        return blob


class _Handler(BaseHTTPRequestHandler):
    """The registry's endpoints (see the module); `registry` is set on a subclass per server."""

    protocol_version = "HTTP/1.1"
    registry: RegistryServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self.do_GET(body=False)

    def do_GET(self, body: bool = True) -> None:
        with self.registry._lock:
            self.registry.requests.append((self.command, self.path, self.headers.get("Range")))
        if self.registry.require_login:
            self._json(401, {"errors": [{"code": "UNAUTHORIZED",
                                         "message": "authentication required"}]})
            return
        if self.path == "/v2/":
            self._json(200, {})
            return
        match = _PATH.match(self.path)
        if match is None:
            self._json(404, {"errors": [{"code": "NAME_UNKNOWN", "message": self.path}]})
        elif match[2] == "manifests":
            self._manifest(match[1], match[3], body)
        else:
            self._blob(match[3], body)

    def _manifest(self, repo: str, tag: str, body: bool) -> None:
        manifest = self.registry.manifests.get((repo, tag))
        if manifest is None:
            self._json(404, {"errors": [{"code": "MANIFEST_UNKNOWN",
                                         "message": f"manifest unknown: {repo}:{tag}"}]})
            return
        self._head(200, MANIFEST_TYPE, len(manifest))
        if body:
            self.wfile.write(manifest)

    def _blob(self, digest: str, body: bool) -> None:
        blob = self.registry.blobs.get(digest)
        if blob is None:
            self._json(404, {"errors": [{"code": "BLOB_UNKNOWN", "message": digest}]})
            return
        start, end = 0, blob.size - 1
        asked = _RANGE.match(self.headers.get("Range") or "")
        if asked is not None:
            start = int(asked[1])
            end = min(int(asked[2]), end) if asked[2] else end
            if start > end:
                self._json(416, {"errors": [{"code": "RANGE_INVALID", "message": ""}]})
                return
        status = 206 if asked is not None else 200
        extra = {"Content-Range": f"bytes {start}-{end}/{blob.size}"} if asked else {}
        self._head(status, "application/octet-stream", end - start + 1, extra)
        if body:
            self._send(blob, start, end + 1, self.registry.hooks.get(digest) or Hooks())

    def _send(self, blob: Blob, start: int, stop: int, hooks: Hooks) -> None:
        """Bytes [start, stop) of `blob`, with its hooks: a flipped byte, a wait, a cut."""
        cut, hooks.cut_at = hooks.cut_at, None
        hold, hooks.hold_at = hooks.hold_at, None
        position = start
        while position < stop:
            limit = min(stop, position + _CHUNK)
            for mark in (cut, hold):  # stop a chunk at a hook's byte
                if mark is not None and position < mark < limit:
                    limit = mark
            if cut is not None and position >= cut:
                self.close_connection = True
                return
            if hold is not None and position >= hold:
                hold = None
                hooks.held.set()
                hooks.released.wait(300)
            chunk = bytearray(blob.read(position, limit - position))
            at = hooks.corrupt_at
            if at is not None and position <= at < limit:
                chunk[at - position] ^= 0xFF
            try:
                self.wfile.write(chunk)
            except OSError:  # the client left
                self.close_connection = True
                return
            position = limit

    def _head(self, status: int, content_type: str, length: int,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self._head(status, "application/json", len(data))
        if self.command != "HEAD":
            self.wfile.write(data)

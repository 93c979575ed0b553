"""A disk tier under the prefix cache (`--kv-cache-disk DIR`, `--kv-cache-disk-size GIB`): full
KV blocks kept in files past the RAM cache's life, so a restarted server, a reloaded model of a
`--models-dir` router or one swapped back in finds an agent's long prompt computed.

- What is written: a cached block's bytes (every layer of its KV layer group, as the kernels
  wrote them) when the RAM cache evicts it, and every cached block at shutdown (a router's
  unload is one). The writes run on a background thread, each to a temporary name and then
  renamed, so a file is whole or absent.
- Where: `DIR/<fingerprint>/<block key>.kv`. The key is the block's hash chain (its whole
  prefix, engine/kv_cache.py), the fingerprint that of the model and every setting that shapes
  the bytes (`model_fingerprint`): weights, tokenizer, dtype, KV cache dtype and layout, block
  size, layer kinds. Another model or setting reads another folder.
- Reading: on a RAM miss, before the prefill is scheduled, the next blocks of the prompt's chain
  are read from their files into free blocks, which then count as cached (and in
  `cached_tokens`). Each file carries the fingerprint, its key, its length and a checksum of
  its bytes; a file that fails any of them is a miss and is deleted, never an error.
- Bounds: past `max_bytes` the least recently used files go. A write that fails (a full disk,
  a read-only folder) turns the tier off with one warning; the server keeps serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("nanoserve")

MAGIC = b"NSKVBLK1"
_HEADER = struct.Struct("<8s16sB17sQ16s")  # magic, fingerprint, key length, key, size, digest
SUFFIX = ".kv"
OWNER = "model.json"  # which checkpoint a fingerprint's folder belongs to


@dataclass
class DiskTierStats:
    """Counters in blocks and bytes (vLLM's style: totals since the start)."""

    hits: int = 0  # blocks read back
    misses: int = 0  # lookups past the RAM cache that found no (good) file
    bytes_read: int = 0
    bytes_written: int = 0


def model_fingerprint(parts: list[str | bytes]) -> bytes:
    """16 bytes naming everything a block's bytes depend on (see the module)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


def file_identity(path: Path) -> bytes:
    """A weights or tokenizer file's identity, cheap at any size: its length and a hash of
    its first and last MiB (the whole file where it is small)."""
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            digest.update(f.read(1 << 20))
    return digest.digest()


class KVDiskTier:
    """The files of one fingerprint under `directory` (see the module)."""

    def __init__(self, directory: Path, max_bytes: int, fingerprint: bytes,
                 model: str = "") -> None:
        """`model`: the checkpoint's path, written beside the files (`OWNER`) so a router
        can tell which of its models are warm on disk (`disk_usage_by_model`)."""
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.folder = Path(directory) / fingerprint.hex()
        self.stats = DiskTierStats()
        self.enabled = True
        self._lock = threading.Lock()
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / OWNER).write_text(json.dumps({"model": model}))
            self._index()
        except OSError as e:
            self._turn_off(e)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    # -- lookups (the core's thread) -------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        with self._lock:
            return self.enabled and key in self._sizes

    def read(self, key: bytes, size: int) -> bytes | None:
        """The block's `size` bytes, or None (and the file deleted) if it is missing, short,
        of another model, or fails its checksum."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._drop(key)
            self.stats.misses += 1
            return None
        payload = self._check(data, key, size)
        if payload is None:
            logger.warning("KV disk tier: %s failed its checks; deleted (a miss)", path.name)
            self._drop(key, delete=True)
            self.stats.misses += 1
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order a restart reads back
        self.stats.hits += 1
        self.stats.bytes_read += len(payload)
        return payload

    def _check(self, data: bytes, key: bytes, size: int) -> bytes | None:
        if len(data) != _HEADER.size + size:
            return None
        magic, fingerprint, key_len, stored_key, length, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if (magic != MAGIC or fingerprint != self.fingerprint or length != size
                or stored_key[:key_len] != key
                or hashlib.blake2b(payload, digest_size=16).digest() != digest):
            return None
        return payload

    # -- writes (queued here, written on the writer thread) -------------------------------------
    def write(self, key: bytes, read_payload: Callable[[], bytes]) -> None:
        """Keep the block under `key`, its bytes read now (before the caller reuses the
        block), written in the background. Nothing when it is on disk already or the tier
        is off."""
        if not self.enabled or self.has(key):
            return
        self._queue.put((key, read_payload()))

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.enabled:
                    self._write_file(*item)
            finally:
                self._queue.task_done()

    def _write_file(self, key: bytes, payload: bytes) -> None:
        header = _HEADER.pack(MAGIC, self.fingerprint, len(key), key, len(payload),
                              hashlib.blake2b(payload, digest_size=16).digest())
        path = self._path(key)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(temporary, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temporary, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                temporary.unlink()
            self._turn_off(e)
            return
        size = len(header) + len(payload)
        self.stats.bytes_written += len(payload)
        with self._lock:
            self._sizes[key] = size
            self._sizes.move_to_end(key)
            evict = []
            while sum(self._sizes.values()) > self.max_bytes and len(self._sizes) > 1:
                old, _ = self._sizes.popitem(last=False)
                evict.append(old)
        for old in evict:
            with contextlib.suppress(OSError):
                self._path(old).unlink()

    # -- the folder ----------------------------------------------------------------------------
    def _index(self) -> None:
        """The files already there, oldest use first; leftovers of killed writes removed."""
        files = []
        for path in self.folder.iterdir():
            if path.name == OWNER:
                continue
            if path.suffix != SUFFIX:
                with contextlib.suppress(OSError):
                    path.unlink()  # a temporary file a killed writer left
                continue
            try:
                key = bytes.fromhex(path.name.removesuffix(SUFFIX))
                stat = path.stat()
            except (ValueError, OSError):
                continue
            files.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(files):
            self._sizes[key] = size

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _drop(self, key: bytes, delete: bool = False) -> None:
        with self._lock:
            self._sizes.pop(key, None)
        if delete:
            with contextlib.suppress(OSError):
                self._path(key).unlink()

    def _turn_off(self, error: OSError) -> None:
        if self.enabled:
            logger.warning("KV disk tier off: %s (%s); serving goes on with the RAM cache "
                           "only", error, self.folder)
        self.enabled = False


def disk_usage_by_model(directory: Path) -> dict[str, tuple[int, int]]:
    """Checkpoint path -> (files, bytes) on the disk tier under `directory` (every
    fingerprint's folder that names its model); empty where there is none."""
    usage: dict[str, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for owner in Path(directory).glob(f"*/{OWNER}"):
            try:
                model = str(json.loads(owner.read_text())["model"])
                sizes = [p.stat().st_size for p in owner.parent.glob(f"*{SUFFIX}")]
            except (OSError, ValueError, KeyError):
                continue
            files, total = usage.get(model, (0, 0))
            usage[model] = (files + len(sizes), total + sum(sizes))
    return usage

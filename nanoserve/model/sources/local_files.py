"""File work both sources share (the hub's cache, the registry's store): a file's sha256, room
on the disk checked before a transfer, a file written whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_room(directory: Path, needed: int) -> None:
    """OSError ENOSPC now, rather than a disk filled to its last byte and a transfer that
    fails."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(errno.ENOSPC, f"{needed} bytes are needed, {free} are free",
                      str(directory))


def write_atomically(path: Path, data: bytes) -> None:
    """`data` as the whole of `path`, or `path` untouched (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

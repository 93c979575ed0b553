"""Image files the image tests share: a PNG that states a size it does not hold."""

from __future__ import annotations

import struct
import zlib


def png_header(width: int, height: int) -> bytes:
    """A PNG that states a size and holds almost no pixel data: its IHDR, and an IDAT chunk
    of a few compressed bytes (Pillow reads up to the first IDAT to open it)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))

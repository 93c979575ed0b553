"""The prefix cache's keys: a full block's hash chained over its parent's hash and its token
ids (and, where an image's placeholders lie in it, the image's content hash and offset). The
engine's KV-cache manager and the API process's data-parallel router hash with these same
functions, so a router's guess names the engine's blocks."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from nanoserve.engine.state_cache import BlockHash
from nanoserve.protocol import ImageInput


def hash_block(parent: BlockHash | None, token_ids: Sequence[int],
               extra_keys: bytes = b"") -> BlockHash:
    """A collision-resistant key for a full block given everything before it; `extra_keys`
    (`image_keys`): what the token ids do not say of it (a text block's hash leaves it out, so
    the keys of text-only prompts, and the disk tier's files, stay what they were)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(extra_keys)
    return digest.digest()


def image_keys(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """The extra keys of the block of tokens [start, end): each image whose placeholders
    overlap it, by its content hash and its offset from the block's start (vLLM's mm extra
    keys). Every image's placeholders are the same token ids: without these two prompts that
    differ only in pixels would share blocks, and the same image one token later would too."""
    return b"".join(image.content_hash + (image.offset - start).to_bytes(8, "little", signed=True)
                    for image in images if image.offset < end and image.end > start)


def chain_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash | None,
                 images: Sequence[ImageInput], hashes: list[BlockHash]) -> list[BlockHash]:
    """`hashes` (the chain of the first full blocks, from `root`) extended in place over
    every full block of `token_ids`; the engine's and the data-parallel router's one chain."""
    for i in range(len(hashes), len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        hashes.append(hash_block(hashes[-1] if hashes else root, token_ids[start:end],
                                 image_keys(images, start, end) if images else b""))
    return hashes


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The parent of a request's first block: None, or with a `cache_salt` a key of the salt,
    so one salt's chain never meets another's (or the unsalted one's)."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode(), digest_size=16).digest()

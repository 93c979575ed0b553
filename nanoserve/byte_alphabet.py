"""GPT-2's byte-level alphabet: the map from each byte to the character that stands for it in
a byte-level BPE vocabulary. The tokenizer builder (model/tokenizer.py) writes vocabularies
with it, and DRY's breakers (dry_breakers.py) read tokens' bytes back through it; it sits at
the bottom of the package so both can import it."""

from __future__ import annotations

from functools import cache


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes that print stay; others move past 255,
    in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}

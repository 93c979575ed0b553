"""DRY's sequence breakers as token sequences: llama.cpp's `get_overlapping_token_sequences`.

A breaker is a string (llama-server's default: newline, colon, double quote, asterisk); DRY
stops a repeat where one occurs (nanoserve/sample/dry.py). The sampler sees token ids, so the
frontend turns each breaker into `[head, *tail]` lists, as llama.cpp's `llama_sampler_init_dry`
does over the vocabulary:

- every token whose text contains the breaker is a breaker by itself: `[token]`;
- every token whose text ends with a proper prefix of the breaker is a head, followed by the
  tokenization of the breaker's rest (at most `MAX_TAIL_TOKENS` tokens): `[token, *tail]`.

A breaker is cut to its first `MAX_BREAKER_BYTES` bytes (UTF-8), llama.cpp's limits; it has
none on their number. A token's text is its bytes as llama.cpp's `token_to_piece` gives them
(special tokens spelled out): for a byte-level BPE vocabulary (GPT-2's, SmolLM2's) the bytes
behind its symbols, else the tokenizer's decoding of the token alone (a `<0xNN>` byte token is
that byte). A rest that is not valid UTF-8 on its own (a prefix ending inside a character) is
tokenized with U+FFFD in place of its broken bytes, as llama.cpp's tokenizer reads it.

The vocabulary's texts are read once per tokenizer (the default model's 49,152 tokens: 0.3 s,
indexed by last byte) and each breaker's sequences kept per tokenizer (a scan: ~10 ms for a
one-byte breaker, ~20 ms for a 40-byte one; 2 Zen 3 cores), so a request with the default
breakers costs four dictionary lookups after the first. This module is the frontend's: it
imports nothing of the engine, the sampler or the model (GPT-2's byte alphabet comes from
byte_alphabet.py, below both).
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from nanoserve.byte_alphabet import byte_alphabet

DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's common_params_sampling
MAX_BREAKER_BYTES = 40  # llama.cpp's MAX_CHAR_LEN: a longer breaker is cut
MAX_TAIL_TOKENS = 20  # llama.cpp's MAX_SEQ_LEN: a longer tail is cut
MAX_CACHED_BREAKERS = 256  # per tokenizer: clients may send any strings
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def dry_breaker_token_ids(tokenizer: Any, breakers: Sequence[str] | None) -> list[list[int]]:
    """The processed breakers of `breakers` (None: llama.cpp's default) for `tokenizer`, a
    transformers tokenizer: each `[head, *tail]` once, sorted. Empty strings are skipped."""
    vocab = _vocabulary(tokenizer)
    found: set[tuple[int, ...]] = set()
    for breaker in DEFAULT_DRY_BREAKERS if breakers is None else breakers:
        text = breaker.encode("utf-8")[:MAX_BREAKER_BYTES]
        if text:
            found.update(vocab.sequences(text))
    return [list(sequence) for sequence in sorted(found)]


def token_texts(tokenizer: Any) -> list[bytes]:
    """Each token's text as bytes, by id (what llama.cpp's `token_to_piece` gives, special
    tokens included)."""
    num_tokens = len(tokenizer)
    symbols = tokenizer.convert_ids_to_tokens(list(range(num_tokens)))
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    is_byte_level = _is_byte_level(tokenizer)
    unicode_to_byte = {c: b for b, c in byte_alphabet().items()}
    texts = []
    for token_id, symbol in enumerate(symbols):
        if token_id in added:
            texts.append(added[token_id].encode("utf-8"))
        elif symbol is None:
            texts.append(b"")
        elif is_byte_level and all(c in unicode_to_byte for c in symbol):
            texts.append(bytes(unicode_to_byte[c] for c in symbol))
        elif match := _BYTE_TOKEN.fullmatch(symbol):
            texts.append(bytes([int(match.group(1), 16)]))
        else:
            texts.append(tokenizer.decode([token_id]).encode("utf-8"))
    return texts


class _Vocabulary:
    """One tokenizer's token texts, indexed by last byte, and its breakers' sequences (LRU)."""

    def __init__(self, tokenizer: Any) -> None:
        self.encode = tokenizer.encode
        self.texts = token_texts(tokenizer)
        self.by_last_byte: list[list[int]] = [[] for _ in range(256)]
        for token_id, text in enumerate(self.texts):
            if text:
                self.by_last_byte[text[-1]].append(token_id)
        self.cached: OrderedDict[bytes, frozenset[tuple[int, ...]]] = OrderedDict()
        self.lock = threading.Lock()

    def sequences(self, breaker: bytes) -> frozenset[tuple[int, ...]]:
        with self.lock:
            if breaker in self.cached:
                self.cached.move_to_end(breaker)
                return self.cached[breaker]
        found = self._scan(breaker)
        with self.lock:
            self.cached[breaker] = found
            while len(self.cached) > MAX_CACHED_BREAKERS:
                self.cached.popitem(last=False)
        return found

    def _scan(self, breaker: bytes) -> frozenset[tuple[int, ...]]:
        texts = self.texts
        containing = {token_id for token_id, text in enumerate(texts) if breaker in text}
        found = {(token_id,) for token_id in containing}
        # a token that ends with the breaker's first k bytes, k < len: the head of [head, *tail]
        for k in range(1, len(breaker)):
            prefix = breaker[:k]
            heads = [t for t in self.by_last_byte[prefix[-1]]
                     if t not in containing and texts[t].endswith(prefix)]
            if heads:
                rest = breaker[k:].decode("utf-8", errors="replace")
                tail = tuple(self.encode(rest, add_special_tokens=False)[:MAX_TAIL_TOKENS])
                found.update((head, *tail) for head in heads)
        return frozenset(found)


_VOCABULARIES: weakref.WeakKeyDictionary[Any, _Vocabulary] = weakref.WeakKeyDictionary()
_VOCABULARIES_LOCK = threading.Lock()


def _vocabulary(tokenizer: Any) -> _Vocabulary:
    """The tokenizer's `_Vocabulary`, built on first use and dropped with the tokenizer."""
    with _VOCABULARIES_LOCK:
        vocab = _VOCABULARIES.get(tokenizer)
    if vocab is None:
        vocab = _Vocabulary(tokenizer)
        with _VOCABULARIES_LOCK:
            vocab = _VOCABULARIES.setdefault(tokenizer, vocab)
    return vocab


def _is_byte_level(tokenizer: Any) -> bool:
    """True when the tokenizer's decoder is byte-level BPE's (symbols stand for bytes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"

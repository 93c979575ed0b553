"""Tokenizers for Hugging Face directories and GGUF files, as transformers tokenizer objects.

A directory's `tokenizer.json` loads through transformers as usual. A GGUF file carries its
vocabulary, merges and chat template as metadata; for byte-level BPE vocabularies (GPT-2 style,
as in SmolLM2) we build the `tokenizers` pipeline from them directly, which takes a fraction of
a second where transformers' own GGUF conversion takes about nine. Other GGUF vocabularies
(sentencepiece, Llama 3's pre-tokenizer, ...) go through transformers' conversion.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from nanoserve.model.gguf_file import GGUFFile

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# `tokenizer.ggml.pre` values whose splitting rules we build ourselves: GPT-2's byte-level regex,
# plus SmolLM's one-digit-per-token split (as its own tokenizer.json has it).
_FAST_PRE_TOKENIZERS = ("gpt2", "smollm", "default")


def load_tokenizer_from_dir(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_tokenizer_from_gguf(gguf: GGUFFile) -> Any:
    meta = gguf.metadata
    if (meta.get("tokenizer.ggml.model") == "gpt2"
            and meta.get("tokenizer.ggml.pre", "default") in _FAST_PRE_TOKENIZERS):
        return _byte_level_tokenizer(meta)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes that print stay; others move past 255)."""
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


def _byte_level_tokenizer(meta: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Tokens written in plain text (rare in byte-level vocabularies) are respelled byte by byte.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and set(t) <= spelled
    ])
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED
    ])

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )

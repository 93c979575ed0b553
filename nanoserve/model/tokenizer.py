"""Tokenizers for Hugging Face directories and GGUF files, as transformers tokenizer objects, or
for the engine core, as the bare `tokenizers` pipeline (`EngineTokenizer`).

A directory's `tokenizer.json` loads through transformers as usual. A GGUF file carries its
vocabulary, merges and chat template as metadata; for byte-level BPE vocabularies (GPT-2 style,
as in SmolLM2) we build the `tokenizers` pipeline from them directly, which takes a fraction of
a second where transformers' own GGUF conversion takes about nine; so for gpt-oss's o200k
(`gpt-4o`: its regex and harmony markup in harmony_tokenizer.py) and for Gemma 4's, which
transformers cannot convert (gemma4_tokenizer.py). Other GGUF vocabularies (sentencepiece,
Llama 3's pre-tokenizer, ...) go through transformers' conversion, once per vocabulary: the
result is kept in the user's cache (`converted_tokenizer_dir`), since Gemma 3's 262k-token
vocabulary took 19.5 s to convert and 4.7 s to load back (2 Zen 4 cores), in each of a
server's two processes.

The engine core never turns ids into text: it reads the vocabulary (the reasoning markers, the
grammar's token set) and the EOS id. Importing transformers and building its tokenizer object
cost the engine process ~2-4 s of every start (2 cores, tiny test models and the default GGUF
alike, where the API process pays the same at the same time); `EngineTokenizer` is the
`tokenizers` pipeline alone, with what transformers would add to it from the directory's
`tokenizer_config.json` (its added tokens, its EOS). tests/model/test_engine_tokenizer.py holds its
vocabulary, EOS and serialized pipeline equal to transformers' for every test model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.byte_alphabet import byte_alphabet
from nanoserve.model.gemma4_tokenizer import gemma4_pipeline, gemma4_tokenizer, is_gemma4_vocabulary
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.harmony_tokenizer import O200K_PATTERN, keep_harmony_format_tokens
from nanoserve.native import user_cache_dir

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# `tokenizer.ggml.pre` values whose splitting rules we build ourselves: GPT-2's byte-level regex,
# plus SmolLM's one-digit-per-token split (as its own tokenizer.json has it), and o200k's regex.
_FAST_PRE_TOKENIZERS = ("gpt2", "smollm", "default", "gpt-4o")


def load_tokenizer_from_dir(path: Path) -> Any:
    """transformers' AutoTokenizer for the directory. Where `tokenizer_config.json` names its
    class (transformers writes it), AutoTokenizer reads of the model's config only its model
    type, so it gets the config as a plain `PreTrainedConfig`: building the family's own
    config class imports the family's modeling stack, 0.9 s of every server's start on 2
    Zen 3 cores (AutoTokenizer itself otherwise). tests/model/test_engine_tokenizer.py holds
    the two equal. A harmony vocabulary's markup is made plain added tokens, kept in decoded
    text (harmony_tokenizer.py)."""
    from transformers import AutoTokenizer, PreTrainedConfig

    config = None
    if (path / "config.json").exists() and _names_its_class(path / "tokenizer_config.json"):
        config_dict, _ = PreTrainedConfig.get_config_dict(str(path))
        config = PreTrainedConfig.from_dict(config_dict)
    tokenizer = AutoTokenizer.from_pretrained(str(path), config=config)
    backend = getattr(tokenizer, "_tokenizer", None)  # (None: a slow tokenizer)
    if backend is not None:
        tokenizer._tokenizer = keep_harmony_format_tokens(backend)
    return tokenizer


def _names_its_class(tokenizer_config: Path) -> bool:
    try:
        return bool(json.loads(tokenizer_config.read_text()).get("tokenizer_class"))
    except (OSError, ValueError):
        return False


def load_tokenizer_from_gguf(gguf: GGUFFile) -> Any:
    meta = gguf.metadata
    if _has_fast_vocabulary(meta):
        return _byte_level_tokenizer(meta)
    if is_gemma4_vocabulary(meta):  # transformers cannot convert it
        return gemma4_tokenizer(meta)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted_tokenizer_dir(gguf)))


def converted_tokenizer_dir(gguf: GGUFFile) -> Path:
    """A directory holding transformers' conversion of the file's vocabulary (tokenizer.json
    and tokenizer_config.json), made on first use and kept in the user's cache under a hash of
    every `tokenizer.*` key, so a changed vocabulary is converted anew. Two processes converting
    at once each write their own directory; the first rename wins."""
    from transformers import AutoTokenizer

    keys = {k: v for k, v in gguf.metadata.items() if k.startswith("tokenizer.")}
    digest = hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()
    target = user_cache_dir() / "tokenizers" / digest[:32]
    if (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        converted = AutoTokenizer.from_pretrained(str(gguf.path.parent),
                                                  gguf_file=gguf.path.name)
        converted.save_pretrained(str(staging))
        os.replace(staging, target)
    except OSError:
        if not (target / "tokenizer.json").exists():  # not another process's finished copy
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass
class EngineTokenizer:
    """What the engine core reads of a tokenizer: the `tokenizers` pipeline (llguidance's
    input), its vocabulary with the added tokens, and the EOS id. No text in or out."""

    backend_tokenizer: Any  # tokenizers.Tokenizer
    eos_token_id: int | None

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))


def load_engine_tokenizer_from_dir(path: Path) -> Any:
    """The directory's `tokenizer.json` with its `tokenizer_config.json`'s added tokens and
    EOS, as transformers would apply them (and a harmony vocabulary's markup kept, as in
    `load_tokenizer_from_dir`); a directory without `tokenizer.json` (a slow,
    sentencepiece-only tokenizer) loads through transformers."""
    if not (path / "tokenizer.json").exists():
        return load_tokenizer_from_dir(path)
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    present = backend.get_vocab(with_added_tokens=True)
    added = [entry for _, entry in sorted(config.get("added_tokens_decoder", {}).items(),
                                          key=lambda item: int(item[0]))]
    for entry in added:
        if entry["content"] not in present:
            token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                               lstrip=entry.get("lstrip", False),
                               rstrip=entry.get("rstrip", False),
                               normalized=entry.get("normalized", True),
                               special=entry.get("special", False))
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    backend = keep_harmony_format_tokens(backend)
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return EngineTokenizer(backend, backend.token_to_id(eos) if isinstance(eos, str) else None)


def load_engine_tokenizer_from_gguf(gguf: GGUFFile) -> Any:
    """The byte-level or Gemma 4 pipeline built from the file's vocabulary, or (other
    vocabularies) transformers' conversion."""
    if is_gemma4_vocabulary(gguf.metadata):
        backend, special = gemma4_pipeline(gguf.metadata)
    elif _has_fast_vocabulary(gguf.metadata):
        backend, special = _byte_level_pipeline(gguf.metadata)
    else:
        return load_engine_tokenizer_from_dir(converted_tokenizer_dir(gguf))
    eos = special["eos_token"]
    return EngineTokenizer(backend, None if eos is None else backend.token_to_id(eos))


def _has_fast_vocabulary(meta: dict[str, Any]) -> bool:
    return (meta.get("tokenizer.ggml.model") == "gpt2"
            and meta.get("tokenizer.ggml.pre", "default") in _FAST_PRE_TOKENIZERS)


def _byte_level_tokenizer(meta: dict[str, Any]) -> Any:
    from transformers import PreTrainedTokenizerFast

    backend, special = _byte_level_pipeline(meta)
    # Given as `tokenizer_object`, transformers deep-copies the pipeline (a serialization and a
    # rebuild: seconds for o200k's 200k tokens); set beforehand, it is taken as it is (as in
    # gemma4_tokenizer.py).
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    PreTrainedTokenizerFast.__init__(tokenizer, **special, clean_up_tokenization_spaces=False,
                                     chat_template=meta.get("tokenizer.chat_template"))
    return tokenizer


def _byte_level_pipeline(meta: dict[str, Any]) -> tuple[Any, dict[str, str | None]]:
    """The `tokenizers` pipeline of a byte-level BPE vocabulary, and its special tokens by
    transformers' names (bos_token, eos_token, unk_token, pad_token). o200k (`gpt-4o`) takes a
    piece that is a token whole, as tiktoken does; a harmony vocabulary's markup is plain
    added tokens (harmony_tokenizer.py)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Tokens written in plain text (rare in byte-level vocabularies) are respelled byte by byte.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                   ignore_merges=pre == "gpt-4o"))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
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
    backend = keep_harmony_format_tokens(backend)

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    return backend, {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                     "unk_token": token("unknown_token_id"),
                     "pad_token": token("padding_token_id")}


def _byte_level_pre_tokenizer(pre: str) -> Any:
    """The splitting rules a `tokenizer.ggml.pre` value names (one of `_FAST_PRE_TOKENIZERS`),
    as the model's own tokenizer.json has them."""
    from tokenizers import Regex, pre_tokenizers

    if pre == "gpt-4o":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return byte_level

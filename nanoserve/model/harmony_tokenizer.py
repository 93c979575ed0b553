"""gpt-oss's vocabulary, o200k_harmony: its pre-tokenizer regex and the harmony format tokens
that decoded text keeps.

o200k is tiktoken's byte-level BPE (`tokenizer.ggml.pre == "gpt-4o"` in a GGUF): the text is
split by `O200K_PATTERN` (tiktoken's `o200k_base` pat_str, as the hub's tokenizer.json and
llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O have it), each piece is taken whole when it is a token
and merged by rank otherwise (tokenizers' `ignore_merges`).

The harmony chat format's markup (`<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, ...) is
special in the hub's tokenizer and CONTROL in a GGUF, so a detokenizer that skips special tokens
(the server's default) would drop it: `analysisWe need… assistantfinalfour`. nanoserve's harmony
parser reads text, so in a harmony vocabulary these tokens are plain added tokens
(`HARMONY_FORMAT_TOKENS`), kept in decoded text and still matched as one id each in input text,
as Gemma 4's markup is (gemma4_tokenizer.py). llama.cpp does the same for four of them (it
forces `<|channel|>`, `<|message|>`, `<|start|>`, `<|constrain|>` to USER_DEFINED,
src/llama-vocab.cpp).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# The harmony format's markup by its o200k_harmony id (openai/harmony docs/format.md).
HARMONY_FORMAT_TOKEN_IDS = {
    "<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
    "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012,
}
HARMONY_FORMAT_TOKENS = frozenset(HARMONY_FORMAT_TOKEN_IDS)


def is_harmony_vocabulary(token_to_id: Callable[[str], int | None]) -> bool:
    """Whether the vocabulary (given by its token -> id lookup) holds the harmony markup at
    o200k_harmony's ids; other vocabularies' `<|end|>` (Phi-3's EOS) stays special."""
    return all(token_to_id(t) == i for t, i in HARMONY_FORMAT_TOKEN_IDS.items())


def keep_harmony_format_tokens(backend: Any) -> Any:
    """The `tokenizers` pipeline with the harmony markup as plain (non-special) added tokens,
    or the pipeline itself when it is no harmony vocabulary.

    A token once added as special stays special whatever is added over it, so the pipeline is
    built anew around the same model, normalizer, pre-tokenizer, post-processor and decoder
    (shared, not copied: under a millisecond, where a JSON round trip of the 200k-token
    vocabulary took 7 s on 2 busy cores), its added tokens added again in id order. Should an
    id come out otherwise (added tokens with gaps between them), the JSON round trip it is."""
    from tokenizers import AddedToken, Tokenizer

    if not is_harmony_vocabulary(backend.token_to_id):
        return backend
    kept = Tokenizer(backend.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if getattr(backend, part) is not None:
            setattr(kept, part, getattr(backend, part))
    if backend.padding is not None:
        kept.enable_padding(**backend.padding)
    if backend.truncation is not None:
        kept.enable_truncation(**backend.truncation)
    kept.encode_special_tokens = backend.encode_special_tokens
    for token_id, token in sorted(backend.get_added_tokens_decoder().items()):
        is_special = token.special and token.content not in HARMONY_FORMAT_TOKENS
        again = AddedToken(token.content, single_word=token.single_word, lstrip=token.lstrip,
                           rstrip=token.rstrip, normalized=token.normalized,
                           special=is_special)
        (kept.add_special_tokens if is_special else kept.add_tokens)([again])
        if kept.token_to_id(token.content) != token_id:
            return _respecified(backend)
    return kept


def _respecified(backend: Any) -> Any:
    """The pipeline rebuilt from its JSON with the harmony markup not special."""
    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in HARMONY_FORMAT_TOKENS:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(data))

"""A model's fill-in-the-middle tokens, found as llama.cpp finds them: a GGUF file's
`tokenizer.ggml.fim_*_token_id` where it names them, else the vocabulary's token of each role
by the spellings llama.cpp looks for (Qwen's `<|fim_prefix|>`, StarCoder's and Granite's
`<fim_prefix>`, DeepSeek's, CodeLlama's `<PRE>`, ...). A model without the prefix, suffix and
middle tokens cannot infill (`FimTokens.missing`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# each role's spellings, in llama.cpp's order (llama-vocab.cpp), and its GGUF key
_SPELLINGS = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
               "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
               "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
               "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}
_GGUF_KEYS = {"prefix": "tokenizer.ggml.fim_pre_token_id",
              "suffix": "tokenizer.ggml.fim_suf_token_id",
              "middle": "tokenizer.ggml.fim_mid_token_id",
              "repo": "tokenizer.ggml.fim_rep_token_id",
              "file_sep": "tokenizer.ggml.fim_sep_token_id"}


@dataclass(frozen=True)
class FimTokens:
    """The model's fill-in-the-middle token ids (None: the vocabulary has none)."""

    prefix: int | None = None
    suffix: int | None = None
    middle: int | None = None
    repo: int | None = None
    file_sep: int | None = None

    @classmethod
    def find(cls, tokenizer: Any, metadata: dict[str, Any] | None = None) -> FimTokens:
        """From a GGUF file's keys where given, else by the tokens' spellings in `tokenizer`'s
        vocabulary (looked up one by one: a 250k vocabulary's whole map takes ~0.3 s)."""
        token_id = _lookup(tokenizer)
        found: dict[str, int | None] = {}
        for role, spellings in _SPELLINGS.items():
            given = (metadata or {}).get(_GGUF_KEYS[role])
            found[role] = (int(given) if given is not None
                           else next((i for s in spellings if (i := token_id(s)) is not None),
                                     None))
        return cls(**found)

    def missing(self) -> list[str]:
        """The roles an infill needs that the model lacks."""
        return [role for role in ("prefix", "suffix", "middle") if getattr(self, role) is None]


def _lookup(tokenizer: Any) -> Callable[[str], int | None]:
    """A token's id, or None where the vocabulary lacks it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: the Rust vocabulary, added tokens included
        return backend.token_to_id
    vocab = tokenizer.get_vocab()
    return vocab.get

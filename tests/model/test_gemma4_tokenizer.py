"""Gemma 4's tokenizer built from a GGUF vocabulary (nanoserve/model/gemma4_tokenizer.py) gives
llama.cpp's ids: on llama.cpp's own test vectors for the real 262,144-token vocabulary, and on
random texts against a Python transcription of llama.cpp's algorithm. Its chat markup stays in
the text the server's detokenizer makes, and the vocabulary's chat template renders with it.

The vocabulary and the vectors come from llama.cpp's source tree (llama_cpp_files.py).
"""

from __future__ import annotations

import random
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from llama_cpp_files import llama_cpp_file

from nanoserve.model.gemma4_tokenizer import GEMMA4_FORMAT_TOKENS
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.tokenizer import (
    EngineTokenizer,
    load_engine_tokenizer_from_gguf,
    load_tokenizer_from_gguf,
)
from nanoserve.output.detokenizer import IncrementalDetokenizer, decode_text

VOCAB = "models/ggml-vocab-gemma-4.gguf"
# each format token's id in the vocabulary (gemma4-gpt-oss.md §6.4)
FORMAT_TOKEN_IDS = {"<|turn>": 105, "<turn|>": 106, "<|think|>": 98, "<|channel>": 100,
                    "<channel|>": 101, "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48,
                    "<tool_call|>": 49, "<|tool_response>": 50, "<tool_response|>": 51,
                    '<|"|>': 52}
BOS, EOS, PAD = 2, 1, 0


@pytest.fixture(scope="module")
def vocab_file() -> GGUFFile:
    return GGUFFile(llama_cpp_file(VOCAB))


@pytest.fixture(scope="module")
def tokenizer(vocab_file: GGUFFile) -> Any:
    return load_tokenizer_from_gguf(vocab_file)


def llama_cpp_vectors() -> list[tuple[str, list[int]]]:
    """The `.inp`/`.out` pairs as llama.cpp's tests/test-tokenizer-0.cpp reads them: inputs
    apart by a marker line, one line of space-separated ids per input."""
    inputs = llama_cpp_file(VOCAB + ".inp").read_bytes().decode("utf-8")
    lines = llama_cpp_file(VOCAB + ".out").read_bytes().decode("utf-8").split("\n")
    texts = inputs.split("\n__ggml_vocab_test__\n")
    assert lines[len(texts):] in ([], [""])
    return [(text, [int(i) for i in line.split()])
            for text, line in zip(texts, lines[: len(texts)], strict=True)]


def test_every_llama_cpp_vector_tokenizes_to_its_ids(tokenizer: Any) -> None:
    """Encoded without BOS, as llama.cpp's test does; and decoded back to the text (llama.cpp
    cleans " ?" to "?" when it decodes; nanoserve, like transformers' Gemma, decodes as is)."""
    vectors = llama_cpp_vectors()
    assert len(vectors) == 46
    wrong = [(text, ids) for text, ids in vectors
             if tokenizer.encode(text, add_special_tokens=False) != ids]
    assert wrong == []
    unreadable = [text for text, ids in vectors
                  if tokenizer.decode(ids, skip_special_tokens=True) != text]
    assert unreadable == []


class LlamaCppTokenizer:
    """llama.cpp's gemma4 tokenization (src/llama-vocab.cpp: `tokenizer_st_partition` with
    special tokens parsed, then `llm_tokenizer_bpe_session::tokenize`), transcribed."""

    def __init__(self, meta: dict[str, Any]) -> None:
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r
                      for r, m in enumerate(meta["tokenizer.ggml.merges"])}
        self.specials = sorted((t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"],
                                                     strict=True) if kind in (3, 4)),
                               key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for fragment in self._fragments(text):
            if isinstance(fragment, int):
                out.append(fragment)
                continue
            for word in self._words(fragment):
                out += self._bpe(word)
        return out

    def _fragments(self, text: str) -> list[str | int]:
        """1) the special tokens' texts are cut out of the text, longest first."""
        fragments: list[str | int] = [text]
        for special in self.specials:
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    cut.append(fragment)
                    continue
                for k, piece in enumerate(fragment.split(special)):
                    cut += ([self.ids[special]] if k else []) + ([piece] if piece else [])
            fragments = cut
        return fragments

    @staticmethod
    def _words(fragment: str) -> list[str]:
        """2) spaces as "▁"; words: the runs of newlines and the runs between them."""
        escaped = fragment.replace(" ", "▁")
        words, start = [], 0
        for k in range(1, len(escaped) + 1):
            if k == len(escaped) or (escaped[k] == "\n") != (escaped[start] == "\n"):
                words.append(escaped[start:k])
                start = k
        return words

    def _bpe(self, word: str) -> list[int]:
        """3) a run of newlines the vocabulary has is one token (PR #21343); else the merges
        by rank, leftmost first among equals; 4) a symbol outside the vocabulary is spelled in
        byte tokens."""
        ids, ranks = self.ids, self.ranks
        symbols = [word] if set(word) == {"\n"} and word in ids else list(word)
        while True:
            ranked = [(ranks[pair], k) for k, pair in enumerate(pairwise(symbols))
                      if pair in ranks]
            if not ranked:
                break
            _, k = min(ranked)
            symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
        out: list[int] = []
        for symbol in symbols:
            out += [ids[symbol]] if symbol in ids else [
                ids[f"<0x{b:02X}>"] for b in symbol.encode("utf-8")]
        return out


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Texts made of what tokenizers get wrong: runs of spaces, newlines (past the 31 the
    vocabulary has whole) and tabs, digits, accents, emoji, joiners, characters only byte
    tokens spell, tokens' own texts (special, user-defined and ones the merges never make)."""
    pieces = [" ", "  ", "\n", "\n\n", "\n" * 40, "\t", "\r\n", "Hello", "world", " the", "3",
              "2024", "é", "Äpfel", "нещо", "我想", "🦙", "😶\u200d🌫️", "\u0000", "\U000e0041",
              "▁", "<unused0>", "[multimodal]", "<|turn>", "<turn|>", '<|"|>', "<bos>",
              "<|tool_call>", "<0x41>", "call:f{a:", "}", "'s", "!!", "...", "\u00a0"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def test_random_texts_tokenize_as_llama_cpp_does(tokenizer: Any, vocab_file: GGUFFile) -> None:
    """With special tokens parsed, as a chat prompt is (llama-server parses them too). The
    transcription gives llama.cpp's ids on its own vectors first."""
    reference = LlamaCppTokenizer(vocab_file.metadata)
    assert all(reference.encode(text) == ids for text, ids in llama_cpp_vectors())
    wrong = [text for text in random_texts(300)
             if tokenizer.encode(text, add_special_tokens=False) != reference.encode(text)]
    assert wrong == []


def test_the_format_tokens_are_one_id_each_and_stay_in_the_output_text(tokenizer: Any) -> None:
    """In a text they are their own ids; from output ids, the server's detokenizer (special
    tokens skipped, its default) gives their text back, and drops <bos>, <eos> and <pad>."""
    assert set(FORMAT_TOKEN_IDS) == GEMMA4_FORMAT_TOKENS
    for token, token_id in FORMAT_TOKEN_IDS.items():
        ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
        assert ids == [*tokenizer.encode("a", add_special_tokens=False), token_id,
                       *tokenizer.encode("b", add_special_tokens=False)]
    text = ('<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather'
            '{city:<|"|>Paris<|"|>}<tool_call|>')
    output_ids = [BOS, *tokenizer.encode(text, add_special_tokens=False), PAD, EOS]
    prompt_ids = tokenizer.encode("<|turn>model\n", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = "".join(detokenizer.update([token_id]) for token_id in output_ids)
    assert streamed + detokenizer.flush() == text
    assert decode_text(tokenizer, output_ids) == text
    assert decode_text(tokenizer, output_ids, skip_special_tokens=False) == \
        f"<bos> {text} <pad> <eos>"


def test_bos_eos_and_the_end_of_generation_tokens(tokenizer: Any) -> None:
    """BOS opens an encoded prompt (llama.cpp adds it to every gemma4 prompt); the tokens
    llama.cpp ends a generation at (the loader's stop ids) are found by their text."""
    assert tokenizer.encode("Hello") == [BOS, *tokenizer.encode("Hello", add_special_tokens=False)]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        (BOS, EOS, PAD)
    vocab = tokenizer.get_vocab()
    assert [vocab[token] for token in ("<eos>", "<turn|>", "<|tool_response>")] == [EOS, 106, 50]


def test_the_engine_tokenizer_is_the_same_pipeline(tokenizer: Any, vocab_file: GGUFFile) -> None:
    engine = load_engine_tokenizer_from_gguf(vocab_file)
    assert isinstance(engine, EngineTokenizer)
    assert engine.eos_token_id == EOS
    assert engine.get_vocab() == tokenizer.get_vocab()
    assert engine.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_the_embedded_chat_template_renders_a_conversation(tokenizer: Any) -> None:
    """The template inside the vocabulary file, through transformers' apply_chat_template (as
    nanoserve renders prompts): turns, thinking and a tool, the markup as single ids."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n"
                      "<|turn>model\nHello!<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n"
                      "<|turn>model\n<|channel>thought\n<channel|>")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [BOS, FORMAT_TOKEN_IDS["<|turn>"]]
    assert ids.count(FORMAT_TOKEN_IDS["<|turn>"]) == 5
    assert ids.count(FORMAT_TOKEN_IDS["<turn|>"]) == 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt.removeprefix("<bos>")

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    prompt = tokenizer.apply_chat_template(messages[1:], tools=[tool], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True)
    assert prompt.startswith("<bos><|turn>system\n<|think|>")
    assert "<|tool>declaration:get_weather{" in prompt
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    for token in ("<|think|>", "<|tool>", "<tool|>", '<|"|>'):
        assert FORMAT_TOKEN_IDS[token] in ids


def test_llama_cpp_files_are_found_by_their_paths() -> None:
    """The helper other tests read templates and test sources with."""
    path = llama_cpp_file("models/templates/google-gemma-4-31B-it.jinja")
    assert isinstance(path, Path)
    assert "<|turn>" in path.read_text()

"""gpt-oss's tokenizer, o200k_harmony (nanoserve/bench/o200k_harmony.py builds it offline;
nanoserve/model/harmony_tokenizer.py holds its regex and kept markup): nanoserve's tokenizer,
from the Hugging Face directory and from a GGUF written by `add_harmony_vocab`, gives the ids
that openai-harmony's own encoding gives, on random texts and on harmony's markup, and the
server's detokenizer keeps the markup in the text the harmony parser reads.

The files are built once a machine into the user's cache (a first build took ~20 s on 2 busy
cores: the ranks from quicktok, the tokenizer directory, the GGUF); the chat template comes from
llama.cpp's source tree (llama_cpp_files.py), so the tests skip where it cannot be fetched.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any

import pytest
from llama_cpp_files import llama_cpp_file

from nanoserve.bench.o200k_harmony import (
    HARMONY_VOCAB_SIZE,
    O200K_BASE_SHA256,
    harmony_encoding_dir,
    harmony_tokenizer_dir,
    harmony_vocab_gguf,
)
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.harmony_tokenizer import HARMONY_FORMAT_TOKEN_IDS
from nanoserve.model.tokenizer import (
    load_engine_tokenizer_from_dir,
    load_engine_tokenizer_from_gguf,
    load_tokenizer_from_dir,
    load_tokenizer_from_gguf,
)
from nanoserve.output.detokenizer import IncrementalDetokenizer

CHAT_TEMPLATE = "models/templates/openai-gpt-oss-120b.jinja"
BOS, EOS, PAD = 199998, 200002, 199999
CONTROL, NORMAL, UNUSED = 3, 1, 5  # llama.cpp token types
# the hub tokenizer's added tokens that openai-harmony's encoding also has (200018 differs)
SHARED_SPECIAL_IDS = range(199998, 200018)


@pytest.fixture(scope="module")
def harmony_encoding() -> Any:
    """openai-harmony's o200k_harmony, loaded offline from the built ranks file."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(harmony_encoding_dir()))
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def vocab_gguf() -> GGUFFile:
    """The vocabulary-only GGUF that `add_harmony_vocab` wrote."""
    return GGUFFile(harmony_vocab_gguf())


@pytest.fixture(scope="module", params=["hf_dir", "gguf"])
def source(request: pytest.FixtureRequest) -> str:
    """Where nanoserve reads the tokenizer from: the directory, or the vocabulary's GGUF."""
    llama_cpp_file(CHAT_TEMPLATE)  # skips where llama.cpp's tree cannot be had
    return str(request.param)


@pytest.fixture(scope="module")
def tokenizer(source: str, vocab_gguf: GGUFFile) -> Any:
    if source == "hf_dir":
        return load_tokenizer_from_dir(harmony_tokenizer_dir())
    return load_tokenizer_from_gguf(vocab_gguf)


def test_the_ranks_file_is_tiktokens() -> None:
    data = (harmony_encoding_dir() / "o200k_base.tiktoken").read_bytes()
    assert hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256
    assert data.count(b"\n") == 199998


def random_texts(num_texts: int, seed: int) -> Iterator[str]:
    """Texts of mixed scripts, digits, whitespace runs, punctuation and contractions: the
    cases o200k's regex splits in its own ways (case runs, marks, 1-3 digit groups, "/")."""
    rng = random.Random(seed)
    pieces = [
        "Hello", "WORLD", "camelCase", "HTTPServer", "don't", "I'LL", "we've", "She'd", "you'RE",
        "o'clock", "naïve", "Ça", "straße", "ﬁle", "e\u0301", "A\u030a", "日本語", "中文字符",
        "カタカナ", "한국어", "Привет", "ΕΛΛΗΝΙΚΑ", "مرحبا", "שלום", "हिन्दी", "தமிழ்", "ภาษาไทย",
        "👍🏽", "👨‍👩‍👧", "🙂", "∑x²", "½", "Ⅻ", "١٢٣", "0", "42", "1234567", "3.14159",
        "1,000,000",
        "...", "?!", "/", "//usr/bin", "--", "—", "“quoted”", "«ça»", "(x)", "[]{}", "#!", "@user",
        "a_b", "\\n", "'", "'s", "`code`", "<|notatoken|>", "<", "|>", "$$", "%", "&&", "~",
    ]
    spaces = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0",
              "\u3000", "", "", " \t\n "]
    for _ in range(num_texts):
        words = [rng.choice(pieces) + rng.choice(spaces) for _ in range(rng.randint(1, 24))]
        yield "".join(words) if rng.random() < 0.8 else "".join(words).strip()


def test_random_texts_tokenize_as_tiktokens_o200k(tokenizer: Any,
                                                  harmony_encoding: Any) -> None:
    texts = list(random_texts(200, seed=2026))
    wrong = [(text, ids) for text in texts
             if (ids := tokenizer.encode(text, add_special_tokens=False))
             != harmony_encoding.encode(text, disallowed_special=())]
    assert wrong == []
    decoded = [tokenizer.decode(harmony_encoding.encode(t, disallowed_special=()))
               for t in texts]
    assert decoded == texts


def test_harmony_special_tokens_encode_to_their_ids(tokenizer: Any,
                                                   harmony_encoding: Any) -> None:
    for token_id in SHARED_SPECIAL_IDS:
        text = harmony_encoding.decode([token_id])
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id], text
    message = ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
               '<|constrain|>json<|message|>{"city": "Paris"}<|call|>'
               "<|start|>user<|message|>Hi<|end|><|startoftext|>x<|endoftext|><|return|>")
    assert (tokenizer.encode(message, add_special_tokens=False)
            == harmony_encoding.encode(message, allowed_special="all"))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        BOS, EOS, PAD)


@pytest.mark.parametrize("is_incremental", [False, True])
def test_decoding_keeps_the_harmony_markup(tokenizer: Any, harmony_encoding: Any,
                                           is_incremental: bool) -> None:
    """With special tokens skipped (the server's default) the markup stays, the other special
    tokens go: what nanoserve's harmony parser reads."""
    text = ("<|channel|>analysis<|message|>We need the weather.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city":"Paris"}<|call|><|start|>assistant<|channel|>final'
            "<|message|>Sunny, 21 °C.<|return|>")
    ids = harmony_encoding.encode(text, allowed_special="all")
    assert set(HARMONY_FORMAT_TOKEN_IDS.values()) <= set(ids)
    ids = [BOS, *ids, PAD]
    if is_incremental:
        detokenizer = IncrementalDetokenizer(tokenizer, [])
        detokenizer.update(ids)
        detokenizer.flush()
        decoded = detokenizer.output_text
    else:
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == text


def test_the_engine_tokenizer_reads_as_transformers(source: str, tokenizer: Any,
                                                    vocab_gguf: GGUFFile) -> None:
    """The engine's `tokenizers` pipeline keeps the same markup, and the same vocabulary."""
    engine = (load_engine_tokenizer_from_dir(harmony_tokenizer_dir()) if source == "hf_dir"
              else load_engine_tokenizer_from_gguf(vocab_gguf))
    assert engine.eos_token_id == tokenizer.eos_token_id == EOS
    assert engine.get_vocab() == tokenizer.get_vocab()
    assert (engine.backend_tokenizer.get_added_tokens_decoder()
            == tokenizer.backend_tokenizer.get_added_tokens_decoder())
    decoded = engine.backend_tokenizer.decode(
        [200006, 200005, 200008, 200007, BOS], skip_special_tokens=True)
    assert decoded == "<|start|><|channel|><|message|><|end|>"


def test_the_gguf_has_llama_cpps_keys(vocab_gguf: GGUFFile) -> None:
    meta = vocab_gguf.metadata
    template = llama_cpp_file(CHAT_TEMPLATE).read_text()
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "gpt-4o")
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"],
            meta["tokenizer.ggml.padding_token_id"]) == (BOS, EOS, PAD)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == HARMONY_VOCAB_SIZE
    assert set(types[:199998]) == {NORMAL}
    assert set(types[199998:200019]) == {CONTROL}
    assert set(types[200019:]) == {UNUSED} and tokens[-1] == "[PAD201087]"
    assert tokens[200005] == "<|channel|>" and tokens[200018] == "<|endofprompt|>"
    assert len(meta["tokenizer.ggml.merges"]) == 446189
    assert meta["tokenizer.chat_template"] == template


def test_the_chat_template_renders_harmony(tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True, reasoning_effort="high")
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: high" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>" in prompt
    assert prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")

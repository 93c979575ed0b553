"""The engine process's tokenizer (the `tokenizers` pipeline alone, no transformers) reads as
transformers' own: the same vocabulary with added tokens, the same EOS, the same serialized
pipeline (what llguidance builds its token set from), for the test checkpoints' directories
(one with added reasoning tokens) and the default GGUF."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import default_model_path

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.tokenizer import (
    EngineTokenizer,
    load_engine_tokenizer_from_dir,
    load_engine_tokenizer_from_gguf,
    load_tokenizer_from_dir,
)
from nanoserve.structured.grammar import GrammarTokenizer


def pipeline(tokenizer: Any) -> dict[str, Any]:
    """The serialized pipeline as llguidance reads it (padding and truncation off)."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    data["padding"] = data["truncation"] = None
    return data


def assert_reads_the_same(engine: Any, full: Any) -> None:
    assert isinstance(engine, EngineTokenizer)
    assert engine.get_vocab() == full.get_vocab()
    assert engine.eos_token_id == full.eos_token_id is not None
    assert pipeline(engine) == pipeline(full)


@pytest.mark.parametrize("family", ["llama", "reasoning"])
def test_a_directory_reads_as_transformers_reads_it(family: str, tiny_model_dir: Any,
                                                    tiny_reasoning_model_dir: Path) -> None:
    path = tiny_reasoning_model_dir if family == "reasoning" else tiny_model_dir("llama")
    engine = load_engine_tokenizer_from_dir(path)
    assert_reads_the_same(engine, load_tokenizer_from_dir(path))
    if family == "reasoning":
        assert {"<think>", "</think>"} <= engine.get_vocab().keys()


def test_the_default_gguf_reads_as_its_transformers_tokenizer(default_tokenizer: Any) -> None:
    assert_reads_the_same(load_engine_tokenizer_from_gguf(GGUFFile(default_model_path())),
                          default_tokenizer)


def test_added_tokens_only_in_the_config_are_added(tiny_model_dir: Any, tmp_path: Path) -> None:
    """A token that tokenizer_config.json lists but tokenizer.json lacks: transformers adds it
    to the pipeline, and so does the engine's loader."""
    for f in tiny_model_dir("llama").glob("tokenizer*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.setdefault("added_tokens_decoder", {})["49152"] = {
        "content": "<|tool_marker|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    engine = load_engine_tokenizer_from_dir(tmp_path)
    assert engine.get_vocab()["<|tool_marker|>"] == 49152
    assert_reads_the_same(engine, load_tokenizer_from_dir(tmp_path))


def test_grammars_compile_against_either(tiny_model_dir: Any) -> None:
    """llguidance's token set from the engine's tokenizer answers as from transformers'."""
    path = tiny_model_dir("llama")
    engine = GrammarTokenizer(load_engine_tokenizer_from_dir(path), 49152, ()).get()
    full = GrammarTokenizer(load_tokenizer_from_dir(path), 49152, ()).get()
    text = 'Hello {"a": [1, 2]} <|im_end|>'
    assert engine.tokenize_str(text) == full.tokenize_str(text)
    assert engine.eos_token == full.eos_token
    assert engine.vocab_size == full.vocab_size


@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_the_engine_tokenizer_imports_no_transformers(source: str, tiny_model_dir: Any) -> None:
    """What the engine process saves: it never imports transformers for its tokenizer."""
    load = (f"load_engine_tokenizer_from_dir(Path({str(tiny_model_dir('llama'))!r}))"
            if source == "directory"
            else f"load_engine_tokenizer_from_gguf(GGUFFile(Path({str(default_model_path())!r})))")
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from nanoserve.model.gguf_file import GGUFFile\n"
            "from nanoserve.model.tokenizer import load_engine_tokenizer_from_dir, "
            "load_engine_tokenizer_from_gguf\n"
            f"{load}\n"
            "print('transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "reasoning", "no class named"])
def test_the_frontend_tokenizer_is_autotokenizers(family: str, tiny_model_dir: Any,
                                                  tiny_reasoning_model_dir: Path,
                                                  tmp_path: Path) -> None:
    """load_tokenizer_from_dir hands AutoTokenizer a plain config (its start is the faster for
    it): the tokenizer is the one AutoTokenizer builds alone, class, vocabulary, special tokens,
    encoding and chat template; without a class named in tokenizer_config.json, it is
    AutoTokenizer's own way."""
    from transformers import AutoTokenizer

    path = tiny_reasoning_model_dir if family == "reasoning" else tiny_model_dir(
        "llama" if family == "no class named" else family)
    if family == "no class named":
        for f in path.iterdir():
            (tmp_path / f.name).symlink_to(f)
        config = json.loads((path / "tokenizer_config.json").read_text())
        del config["tokenizer_class"]
        (tmp_path / "tokenizer_config.json").unlink()
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        path = tmp_path
    ours, theirs = load_tokenizer_from_dir(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.special_tokens_map == theirs.special_tokens_map
    text = "Hello, world! <think>2 + 2</think> = 4"
    assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

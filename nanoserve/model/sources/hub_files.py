"""Which of a hub repository's files a name asks for: a safetensors checkpoint's files the loader
reads, or one quant of a GGUF repository with its split parts (llama.cpp's `-hf` rule).

Names only, from the repository's file list as the hub gives it (or as the cache holds it):
nothing here downloads, so the rule is tested on lists alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nanoserve.model.gguf_split import parse_part_name, part_name
from nanoserve.model.sources.names import DEFAULT_GGUF_QUANT

SAFETENSORS_INDEX = "model.safetensors.index.json"
# What the loader and the tokenizer read of a checkpoint besides its weights (model/loader.py,
# model/tokenizer.py, transformers' AutoTokenizer): config, generation config, tokenizer files
# of each kind, the chat template in its own file. READMEs, other weight formats (.bin, .pt,
# onnx/) and the original/ copies that many repositories also hold are never fetched.
CHECKPOINT_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "merges.txt", "chat_template.jinja", "chat_template.json", SAFETENSORS_INDEX})


@dataclass(frozen=True)
class RepoFile:
    """One file of a repository at a commit, as the hub lists it."""

    path: str  # relative to the repository's root, "/"-separated
    size: int | None = None
    sha256: str | None = None  # an LFS file's sha256 (the hub's checksum); None for a git file
    blob_id: str | None = None  # the git blob's sha1 (for an LFS file, its pointer's)


def is_checkpoint(files: list[RepoFile]) -> bool:
    """A transformers checkpoint: a config.json and safetensors weights at the top."""
    names = {f.path for f in files}
    return "config.json" in names and any(_is_top_safetensors(f.path) for f in files)


def checkpoint_files(files: list[RepoFile], shards: set[str] | None = None) -> list[RepoFile]:
    """The files to fetch of a checkpoint: its loader files and its weights; `shards` (the
    index's weight_map values) limits the weights to those the index names, as vLLM does, so a
    repository that holds a consolidated copy beside its shards is fetched once."""
    return [f for f in files if f.path in CHECKPOINT_FILES
            or (_is_top_safetensors(f.path) and (shards is None or f.path in shards))]


def gguf_files(files: list[RepoFile]) -> list[RepoFile]:
    """The repository's model GGUFs in list order: a multimodal projector (`mmproj*`) is not
    a model."""
    return [f for f in files if f.path.lower().endswith(".gguf")
            and "mmproj" not in PurePosixPath(f.path).name.lower()]


def carries_quant(path: str, quant: str) -> bool:
    """Whether the file's name carries `quant` (any case) as a whole word: `Q4_K` is not in
    `model-Q4_K_M.gguf`, nor `F16` in `model-BF16.gguf`."""
    word = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(word, path, re.IGNORECASE) is not None


def choose_gguf(files: list[RepoFile], quant: str | None) -> list[RepoFile] | None:
    """llama.cpp's `-hf` rule: the first model GGUF whose name carries `quant` (Q4_K_M when
    None), else, with no quant asked, the first model GGUF. A split file brings every part
    of its model, the first part first (the loader takes it and finds the others beside it).
    None when the asked quant (or any GGUF) is not there; [] when a split part is missing."""
    ggufs = gguf_files(files)
    chosen = next((f for f in ggufs if carries_quant(f.path, quant or DEFAULT_GGUF_QUANT)),
                  None)
    if chosen is None and quant is None and ggufs:
        chosen = ggufs[0]
    return None if chosen is None else with_split_parts(chosen, files)


def with_split_parts(chosen: RepoFile, files: list[RepoFile]) -> list[RepoFile]:
    """`chosen` alone, or, for a part of a split model, all its parts in order ([] if one is
    not in `files`)."""
    path = Path(chosen.path)
    split = parse_part_name(path)
    if split is None:
        return [chosen]
    by_path = {f.path: f for f in files}
    names = [path.with_name(part_name(split.prefix, part, split.num_parts)).as_posix()
             for part in range(1, split.num_parts + 1)]
    return [by_path[name] for name in names] if all(n in by_path for n in names) else []


def offered_quants(files: list[RepoFile]) -> list[str]:
    """The quants the model GGUFs' names end with (`model-Q8_0.gguf`, `model.q8_0.gguf`,
    `model-Q8_0-00001-of-00002.gguf` → Q8_0), each once, in list order."""
    quants: list[str] = []
    for f in gguf_files(files):
        name = PurePosixPath(f.path).name
        split = parse_part_name(Path(name))
        stem = split.prefix if split is not None else name[:-len(".gguf")]
        quant = re.split(r"[-.]", stem)[-1].upper()
        if quant not in quants:
            quants.append(quant)
    return quants


def _is_top_safetensors(path: str) -> bool:
    return "/" not in path and path.endswith(".safetensors")

"""The names of a split GGUF's parts, as llama.cpp's `gguf-split` writes them:
`<prefix>-00001-of-00003.gguf`, `<prefix>-00002-of-00003.gguf`, ...

A split model is loaded from its first part, which holds the metadata; the others are found
beside it by this pattern, and a later part given is refused, naming the first. That is what
llama.cpp does (llama_get_list_splits; llama-model-loader.cpp: "model must be loaded with the
first split"), so a path that works there works here. Names only: nothing here opens a file, so
model_path.py checks a path with it before any process starts (gguf_file.py reads the parts and
checks their `split.*` keys).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The metadata keys every part carries (gguf-py's Keys.Split; llama-arch.cpp's LLM_KV_SPLIT_*)
SPLIT_NO = "split.no"  # this part's index, 0 for the first (the name counts from 1)
SPLIT_COUNT = "split.count"  # how many parts
SPLIT_TENSORS_COUNT = "split.tensors.count"  # the tensors of all parts together

_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<part>\d{5})-of-(?P<num_parts>\d{5})\.gguf$")


@dataclass(frozen=True)
class SplitName:
    """A part's place in its split model, as its file name says it."""

    prefix: str  # the name before "-00002-of-00003.gguf"
    part: int  # counted from 1, as in the name
    num_parts: int


def part_name(prefix: str, part: int, num_parts: int) -> str:
    """The file name of part `part` (from 1) of `num_parts`: llama.cpp's `%s-%05d-of-%05d.gguf`."""
    return f"{prefix}-{part:05d}-of-{num_parts:05d}.gguf"


def parse_part_name(path: Path) -> SplitName | None:
    """`path`'s place in a split model by its name; None for a name outside the pattern."""
    match = _PART_NAME.match(path.name)
    if match is None:
        return None
    return SplitName(match["prefix"], int(match["part"]), int(match["num_parts"]))


def split_part_paths(first: Path, num_parts: int) -> list[Path] | None:
    """Every part's path, in order, beside `first` (the path as given: in Hugging Face's cache it
    is a link whose target is named by its hash, so it is never resolved); None when `first` is
    not named as part 1 of `num_parts`."""
    name = parse_part_name(first)
    if name is None or (name.part, name.num_parts) != (1, num_parts):
        return None
    return [first.with_name(part_name(name.prefix, i, num_parts))
            for i in range(1, num_parts + 1)]


def first_part_error(path: Path, part: int, num_parts: int) -> ValueError:
    """The error for a path that holds part `part` (from 1) of a split model, not its first."""
    name = parse_part_name(path)
    first = "" if name is None else f" ({part_name(name.prefix, 1, num_parts)})"
    return ValueError(f"{str(path)!r} is part {part} of {num_parts} of a split GGUF model: give "
                      f"its first part{first}, which holds the metadata and names the others "
                      "(as llama.cpp does)")


def missing_part_error(first: Path, part_path: Path, part: int, num_parts: int
                       ) -> FileNotFoundError:
    """The error for a part of the split model `first` begins that is not beside it."""
    return FileNotFoundError(f"part {part} of {num_parts} of the split GGUF model "
                             f"{str(first)!r}, {part_path.name}, is missing from "
                             f"{str(part_path.parent)!r}; download every part beside the first")


def check_split_parts_by_name(path: Path) -> None:
    """Refuse, by file names alone, a later part given for a split model, or a first part whose
    other parts are not beside it; a name outside the pattern passes (its file's own `split.*`
    keys are checked when it is read)."""
    name = parse_part_name(path)
    if name is None or name.num_parts <= 1:
        return
    if name.part != 1:
        raise first_part_error(path, name.part, name.num_parts)
    for index, part_path in enumerate(split_part_paths(path, name.num_parts) or [], 1):
        if not part_path.exists():
            raise missing_part_error(path, part_path, index, name.num_parts)


def first_part_of_one_split(paths: list[Path]) -> Path | None:
    """The first part, when `paths` are all the parts of one split model (a directory holding
    just that model); None otherwise."""
    names = [parse_part_name(path) for path in paths]
    if not names or any(name is None for name in names):
        return None
    firsts = [path for path, name in zip(paths, names, strict=True) if name and name.part == 1]
    if len(firsts) != 1:
        return None
    expected = split_part_paths(firsts[0], len(paths))
    return firsts[0] if expected is not None and set(expected) == set(paths) else None


def gguf_model_files(path: Path) -> list[Path]:
    """The files a GGUF model given as `path` is read from: every part, where its name says it
    is the first of a split model; else `path` alone."""
    name = parse_part_name(path)
    parts = None if name is None else split_part_paths(path, name.num_parts)
    return parts or [path]

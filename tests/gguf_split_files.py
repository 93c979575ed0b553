"""Split GGUF files for tests, as llama.cpp's `gguf-split --split` writes them: parts named
`<stem>-00001-of-0000N.gguf`, ...; the first holds all of the metadata, every part its share of
the tensors and the `split.no` / `split.count` / `split.tensors.count` keys (gguf-py's writer
writes that layout when it shards)."""

from __future__ import annotations

from pathlib import Path

import gguf

from nanoserve.model.gguf_file import GGUFFile

# Written by the writer itself: the architecture (by its constructor), the alignment (with the
# tensors' padding), the split keys (for each part)
_WRITER_KEYS = ("general.architecture", "general.alignment", "split.")


def split_gguf(source: Path, out_dir: Path, parts: int, stem: str | None = None) -> list[Path]:
    """`source` (one GGUF file, or the first part of a split one) written as `parts` files in
    `out_dir`, named `<stem>-00001-of-<parts>.gguf`, ... (`stem`: the source's own stem by
    default); their paths, in order. Metadata keys keep their GGUF value types; tensors keep
    their order and are copied as their raw (quantized) bytes, as even by count as they go
    (the first parts one more where they do not divide). ValueError unless 2 <= `parts` <= the
    number of tensors."""
    file = GGUFFile(source)
    num_tensors = len(file.tensors)
    if not 2 <= parts <= num_tensors:
        raise ValueError(f"cannot split {source.name}'s {num_tensors} tensors into {parts} parts "
                         "(2 or more, each with a tensor)")
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out_dir / f"{stem or source.stem}.gguf",
                             file.metadata["general.architecture"])
    if "general.alignment" in file.metadata:
        writer.add_custom_alignment(int(file.metadata["general.alignment"]))
    for key, value in file.metadata.items():
        if not key.startswith(_WRITER_KEYS):
            writer.add_key_value(key, value, *_value_types(file, key))
    firsts = _first_tensor_of_each_part(num_tensors, parts)
    for index, (name, tensor) in enumerate(file.tensors.items()):
        # The writer starts a new part when the one it fills has `split_max_tensors` tensors
        # (0: no limit); a limit of 1 at each boundary gives parts of exactly the sizes chosen.
        writer.split_max_tensors = 1 if index in firsts else 0
        byte_rows = tensor.data.reshape(*tensor.shape[:-1], -1)  # a view: no copy of the bytes
        writer.add_tensor(name, byte_rows, raw_dtype=gguf.GGMLQuantizationType(tensor.ggml_type))
    assert writer.path is not None and len(writer.tensors) == parts
    paths = writer.format_shard_names(writer.path)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return paths


def _value_types(file: GGUFFile, key: str) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    type_id, item_type = file.metadata_types[key]
    if item_type == gguf.GGUFValueType.ARRAY:
        raise NotImplementedError(f"{key}: arrays of arrays are not copied")
    return gguf.GGUFValueType(type_id), None if item_type is None else gguf.GGUFValueType(item_type)


def _first_tensor_of_each_part(num_tensors: int, parts: int) -> set[int]:
    """The index of each part's first tensor but the first part's."""
    size, extra = divmod(num_tensors, parts)
    starts, start = set(), 0
    for part in range(parts - 1):
        start += size + (part < extra)
        starts.add(start)
    return starts

"""A small GGUF reader: metadata as Python values, tensors as memory-mapped views.

The `gguf` package's own reader builds a Python object for every array element (about 4 s for
the default model's 49,152-token vocabulary); reading the layout directly takes milliseconds.
Dequantization is left to `gguf.quants`, which knows every block format.
A model split by llama.cpp's `gguf-split` is read from its first part as one file: the first
part's metadata, every part's tensors (each part mapped on its own; gguf_split.py names them).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nanoserve.model.gguf_split import (
    SPLIT_COUNT,
    SPLIT_NO,
    SPLIT_TENSORS_COUNT,
    first_part_error,
    missing_part_error,
    split_part_paths,
)

if TYPE_CHECKING:  # the reader itself needs no torch: an API process reads its tokenizer here
    import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, numpy dtype) for the fixed-size scalars
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's raw bytes (a view into the mapped file) and how to read them."""

    name: str
    shape: tuple[int, ...]  # PyTorch order: outermost first (GGUF stores it innermost first)
    ggml_type: int
    data: np.ndarray  # raw bytes, uint8

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


class GGUFFile:
    """Metadata and tensors of a GGUF model, read without copying tensor data: one file, or a
    split model given by its first part (`name-00001-of-00003.gguf`), whose metadata is the
    first part's (with its `split.*` keys) and whose tensors are all its parts'. A later part
    given, a part missing, or parts that disagree are a one-line error naming the file."""

    def __init__(self, path: str | Path) -> None:
        first = GGUFPart(Path(path))
        parts = _split_parts(first)
        self.path = first.path  # the first part's, as given (not resolved)
        self.part_paths = tuple(part.path for part in parts)
        self.metadata = first.metadata
        # key -> (GGUF value type id, an array's item type id or None): to write it back as is
        self.metadata_types = first.metadata_types
        self.tensors = _all_tensors(parts, first)

    # -- reading tensors ----------------------------------------------------------------------
    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as float32 (a copy), whatever block format it is stored in."""
        import torch  # the engine's loader calls it, with torch loaded already
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from nanoserve.model.dequant import dequantize_fast

        tensor = self.tensors[name]
        fast = dequantize_fast(tensor.data, tensor.ggml_type, tensor.shape)
        if fast is not None:
            return fast
        qtype = GGMLQuantizationType(tensor.ggml_type)
        row_bytes = tensor.data.reshape(int(np.prod(tensor.shape[:-1])) or 1, -1)
        try:
            values = dequantize(row_bytes, qtype)
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {name!r} uses quantization {qtype.name}, which the gguf "
                "package cannot dequantize; use a file quantized as F32/F16/BF16/Q8_0/Q4_K/..."
            ) from None
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(tensor.shape))


def _split_parts(first: GGUFPart) -> list[GGUFPart]:
    """`first` and, where its metadata says it begins a split model, its other parts, each
    checked to be the part its name says (llama.cpp checks `split.no`; `split.count` too here,
    since a part left from another split of the same name would be read as this one's)."""
    num_parts = int(first.metadata.get(SPLIT_COUNT, 1))
    if num_parts <= 1:
        return [first]
    if first.metadata.get(SPLIT_NO, 0) != 0:
        raise first_part_error(first.path, int(first.metadata[SPLIT_NO]) + 1, num_parts)
    paths = split_part_paths(first.path, num_parts)
    if paths is None:
        raise ValueError(f"{str(first.path)!r} is the first of {num_parts} parts of a split GGUF "
                         f"model, but its name does not end in '-00001-of-{num_parts:05d}.gguf', "
                         "the name its other parts are found by; rename it as gguf-split wrote it")
    parts = [first]
    for index, path in enumerate(paths[1:], 1):
        if not path.exists():
            raise missing_part_error(first.path, path, index + 1, num_parts)
        part = GGUFPart(path)
        count, number = part.metadata.get(SPLIT_COUNT), part.metadata.get(SPLIT_NO)
        if count != num_parts:
            raise ValueError(f"{str(path)!r} says it is one of {count} parts (split.count), but "
                             f"the first part says {num_parts}: the parts are from different "
                             "splits; download them again")
        if number != index:
            raise ValueError(f"{str(path)!r} has split.no {number}, but part {index + 1} of "
                             f"a split has {index} (split.no counts from 0): the parts are "
                             "mixed up; download them again")
        parts.append(part)
    return parts


def _all_tensors(parts: list[GGUFPart], first: GGUFPart) -> dict[str, GGUFTensor]:
    """Every part's tensors by name, each once, as many as the first part's
    `split.tensors.count` says (llama.cpp's two checks)."""
    tensors: dict[str, GGUFTensor] = {}
    for part in parts:
        for name, tensor in part.tensors.items():
            if name in tensors:
                raise ValueError(f"split GGUF model {str(first.path)!r}: tensor {name!r} is in "
                                 f"more than one part (again in {part.path.name}); download "
                                 "the parts again")
            tensors[name] = tensor
    expected = first.metadata.get(SPLIT_TENSORS_COUNT)
    if len(parts) > 1 and expected is not None and len(tensors) != expected:
        raise ValueError(f"split GGUF model {str(first.path)!r}: its {len(parts)} parts hold "
                         f"{len(tensors)} tensors, but its split.tensors.count says {expected}; "
                         "a part is from another split or damaged: download the parts again")
    return tensors


class GGUFPart:
    """One GGUF file's header, parsed: its metadata and its tensors as views into its map."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = self._mm.data
        self._pos = 0
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (its first bytes are not 'GGUF')")
        self._pos = 4
        version = self._scalar(4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is too old (need 2 or 3)")
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[int, int | None]] = {}
        try:
            num_tensors, num_fields = self._scalar(10), self._scalar(10)
            for _ in range(num_fields):
                key = self._string()
                type_id = self._scalar(4)
                item_type = (struct.unpack_from("<I", self._buf, self._pos)[0]
                             if type_id == _ARRAY else None)
                self.metadata_types[key] = (type_id, item_type)
                self.metadata[key] = self._value(type_id)
            infos = [self._tensor_info() for _ in range(num_tensors)]
        except (struct.error, ValueError) as e:  # the header runs past the end of the file
            raise self._truncated(f"its header cannot be read ({e})") from None
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {info[0]: self._tensor(data_start, *info) for info in infos}

    def _truncated(self, what: str) -> ValueError:
        return ValueError(f"GGUF file {str(self.path)!r} is truncated or damaged: {what}; an "
                          "interrupted download or copy leaves a short file: fetch it again")

    # -- parsing ------------------------------------------------------------------------------
    def _scalar(self, type_id: int) -> Any:
        fmt, _ = _SCALARS[type_id]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar(10)
        raw = bytes(self._buf[self._pos : self._pos + length])
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self._string()
        if type_id == _ARRAY:
            item_type, count = self._scalar(4), self._scalar(10)
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            _, dtype = _SCALARS[item_type]
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        return self._scalar(type_id)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar(4)
        dims = tuple(self._scalar(10) for _ in range(num_dims))
        ggml_type, offset = self._scalar(4), self._scalar(10)
        return name, tuple(reversed(dims)), ggml_type, offset

    def _tensor(self, data_start: int, name: str, shape: tuple[int, ...], ggml_type: int,
                offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}") \
                from None
        num_bytes = int(np.prod(shape)) // block_size * type_size
        start = data_start + offset
        if start + num_bytes > len(self._mm):
            raise self._truncated(f"tensor {name!r} ends at byte {start + num_bytes:,} but the "
                                  f"file has {len(self._mm):,} bytes")
        return GGUFTensor(name, shape, ggml_type, self._mm[start : start + num_bytes])

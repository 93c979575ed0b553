"""A small GGUF reader: metadata as Python values, tensors as memory-mapped views.

The `gguf` package's own reader builds a Python object for every array element (about 4 s for
the default model's 49,152-token vocabulary); reading the layout directly takes milliseconds.
Dequantization is left to `gguf.quants`, which knows every block format.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoserve.model.dequant import dequantize_fast

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
    """Metadata and tensors of a GGUF file, read without copying tensor data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
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
        try:
            num_tensors, num_fields = self._scalar(10), self._scalar(10)
            for _ in range(num_fields):
                key = self._string()
                self.metadata[key] = self._value(self._scalar(4))
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

    # -- reading tensors ----------------------------------------------------------------------
    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as float32 (a copy), whatever block format it is stored in."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

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

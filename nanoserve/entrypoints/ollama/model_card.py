"""What Ollama's listing routes say about the served model (`/api/tags`, `/api/ps`,
`/api/show`): read once, when the app is built, from the checkpoint's own file.

- `size`: the bytes on disk (a GGUF file; a Hugging Face directory's weight files).
- `digest`: the SHA-256 of the file's resolved path, size and modification time (nanoseconds),
  as hex. Ollama's digest hashes its manifest; hashing a multi-gigabyte file at start-up would
  cost seconds, and these three change whenever the file does, so the digest does too.
- `details`: `format` ("gguf" or "safetensors"), `family` (the architecture: GGUF's
  `general.architecture`, config.json's `model_type`), `parameter_size` (GGUF's
  `general.size_label`, else the weights' element count written as Ollama writes it, "135M",
  "8.0B"), `quantization_level` (GGUF's file type, "Q4_1"; the weights' dtype, "BF16").
- `model_info`: the GGUF file's scalar metadata (the tokenizer's tables and the chat template
  left out, as Ollama leaves them out unless asked to be verbose), or the same keys read from
  config.json; `<arch>.context_length` is always there.
A checkpoint that cannot be read this way (a test's context without a file) gets empty details
rather than a failed server: these routes describe, they serve nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.model_path import resolve_model_path

# the oldest Ollama that Codex's `--oss` (0.171) accepts before it sends /v1/responses ("Ollama
# 0.1.0 is too old. Codex requires Ollama 0.13.4 or newer"); what /api/version answers, on one
# model's server and on the router (nanoserve's own version is at /version)
OLLAMA_API_VERSION = "0.13.4"

_DTYPE_LEVELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# config.json's names for the keys Ollama's model_info gives under "<arch>."
_HF_INFO_KEYS = {"max_position_embeddings": "context_length", "hidden_size": "embedding_length",
                 "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
                 "num_attention_heads": "attention.head_count",
                 "num_key_value_heads": "attention.head_count_kv", "vocab_size": "vocab_size",
                 "rope_theta": "rope.freq_base"}
_MAX_INFO_TEXT = 256  # longer GGUF strings (a chat template, a license text) are left out


@dataclass(frozen=True)
class ModelCard:
    """The served model as Ollama's listing routes describe it (see the module)."""

    path: str
    size: int = 0
    digest: str = ""
    modified_at: str = "1970-01-01T00:00:00Z"
    details: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)


def read_model_card(model_path: str) -> ModelCard:
    """The card of the checkpoint `model_path` names (a file, a directory or the default's
    alias); empty details where it cannot be read (see the module)."""
    try:
        path = resolve_model_path(model_path or None)
        if path.is_dir():
            size, (details, info) = _dir_size(path), _hf_details(path)
        else:
            size, (details, info) = path.stat().st_size, _gguf_details(path)
    except (OSError, ValueError, KeyError):
        return ModelCard(path=model_path)
    mtime_ns = path.stat().st_mtime_ns
    digest = hashlib.sha256(f"{path.resolve()}\0{size}\0{mtime_ns}".encode()).hexdigest()
    return ModelCard(path=str(path), size=size, digest=digest,
                     modified_at=rfc3339(mtime_ns / 1e9), details=details, model_info=info)


def rfc3339(seconds: float) -> str:
    """A Unix time as Ollama writes times: UTC, microseconds, `Z`."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parameter_size(count: int) -> str:
    """An element count as Ollama writes one: "135M", "1.7B"."""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    if count >= 1_000_000:
        return f"{count / 1e6:.0f}M"
    return f"{count / 1e3:.0f}K"


def _details(fmt: str, family: str, size_label: str, level: str) -> dict[str, Any]:
    return {"parent_model": "", "format": fmt, "family": family,
            "families": [family] if family else None, "parameter_size": size_label,
            "quantization_level": level}


def _gguf_details(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from gguf import LlamaFileType  # the file-type names ("MOSTLY_Q4_1"), as llama.cpp's

    gguf = GGUFFile(path)
    meta = gguf.metadata
    arch = str(meta.get("general.architecture", ""))
    count = sum(_product(tensor.shape) for tensor in gguf.tensors.values())
    level = ""
    if "general.file_type" in meta:
        try:
            level = LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
        except ValueError:
            level = str(meta["general.file_type"])
    info = {key: value for key, value in meta.items()
            if not key.startswith("tokenizer.") and not isinstance(value, list | dict)
            and not (isinstance(value, str) and len(value) > _MAX_INFO_TEXT)}
    info["general.parameter_count"] = count
    label = str(meta.get("general.size_label") or parameter_size(count))
    return _details("gguf", arch, label, level), info


def _hf_details(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    arch = str(config.get("model_type", ""))
    count = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            count += sum(_product(weights.get_slice(name).get_shape())
                         for name in weights.keys())  # noqa: SIM118 (not a dict)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": count}
    info.update({f"{arch}.{name}": config[key] for key, name in _HF_INFO_KEYS.items()
                 if key in config})
    return (_details("safetensors", arch, parameter_size(count),
                     _DTYPE_LEVELS.get(dtype, dtype.upper())), info)


def _dir_size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.glob("*.safetensors"))


def _product(shape: Any) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count

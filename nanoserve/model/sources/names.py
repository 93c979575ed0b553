"""A model's name as users spell it, parsed: a hub repository or an Ollama registry name.

    org/repo                  a hub repository: a safetensors checkpoint, or a GGUF repository
                              (then its Q4_K_M file, else its first: llama.cpp's `-hf` rule)
    org/repo:Q8_0             a GGUF repository's file of that quant (llama.cpp's `-hf`)
    hf.co/org/repo:Q8_0       the same, as Ollama spells it (`huggingface.co/` too)
    qwen3.5:0.8b, smollm2     an Ollama library name (tag `latest` when none is given)
    host[:port]/ns/model:tag  a name on another registry (its host has a dot, a port or is
                              `localhost`), as Ollama spells those

`org/repo` is always the hub's, as vLLM and llama.cpp read it; an Ollama user's namespace is
reached with the registry's host in front (`registry.ollama.ai/user/model:tag`). Anything that
exists on disk, or reads as a path (`/`, `./`, `../`, `~` in front, or a `.gguf` at the end), is
a path and never a name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_QUANT = "Q4_K_M"  # llama.cpp's `-hf` default, and Ollama's for hf.co names
HUB_HOSTS = ("hf.co/", "huggingface.co/")

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_REPO = re.compile(rf"^({_PART})/({_PART})(?::({_PART}))?$")
_LIBRARY = re.compile(rf"^({_PART})(?::({_PART}))?$")
_REGISTRY = re.compile(rf"^([A-Za-z0-9.-]+(?::\d+)?)/({_PART})/({_PART})(?::({_PART}))?$")


@dataclass(frozen=True)
class HubName:
    """A repository on the hub (`huggingface_hub`'s endpoint: `HF_ENDPOINT`)."""

    repo: str  # "org/repo"
    quant: str | None = None  # "Q8_0": a GGUF file of that quant; None: the default rule
    revision: str | None = None  # a branch, tag or commit; None: the default branch
    is_gguf: bool = False  # spelled hf.co/...: a GGUF repository, as Ollama reads it

    def __str__(self) -> str:
        name = self.repo + (f":{self.quant}" if self.quant else "")
        return "hf.co/" + name if self.is_gguf else name


@dataclass(frozen=True)
class RegistryName:
    """A model on an OCI registry that speaks Ollama's manifest format."""

    host: str | None  # "registry.ollama.ai", "127.0.0.1:5000"; None: the configured registry
    namespace: str  # "library" for Ollama's own models
    model: str
    tag: str = "latest"

    def __str__(self) -> str:
        """As `ollama list` shows it: `model:tag` for the default registry's library."""
        if self.host is None and self.namespace == "library":
            return f"{self.model}:{self.tag}"
        prefix = f"{self.host}/" if self.host else ""
        return f"{prefix}{self.namespace}/{self.model}:{self.tag}"


ModelName = HubName | RegistryName


def looks_like_path(text: str) -> bool:
    """Spelled as a path: never read as a name, whether or not it exists."""
    return (text.startswith(("/", "./", "../", "~", ".\\")) or text.endswith(".gguf")
            or text in (".", "..") or Path(text).exists())


def parse_model_name(text: str, revision: str | None = None) -> ModelName | None:
    """The name `text` spells, or None if it is a path (or spells no name at all)."""
    if looks_like_path(text):
        return None
    for host in HUB_HOSTS:
        if text.lower().startswith(host):
            hub = _HUB_REPO.match(text[len(host):])
            if hub is None:
                return None
            return HubName(f"{hub[1]}/{hub[2]}", _quant(hub[3]), revision, is_gguf=True)
    if hub := _HUB_REPO.match(text):
        return HubName(f"{hub[1]}/{hub[2]}", _quant(hub[3]), revision)
    if library := _LIBRARY.match(text):
        return RegistryName(None, "library", library[1].lower(), (library[2] or "latest").lower())
    if other := _REGISTRY.match(text):
        host = other[1]
        if "." in host or ":" in host or host == "localhost":
            return RegistryName(host, other[2].lower(), other[3].lower(),
                                (other[4] or "latest").lower())
    return None


def _quant(tag: str | None) -> str | None:
    """A GGUF quant tag as given (`q4_k_m` and `Q4_K_M` are the same file); `latest` is none."""
    return None if tag is None or tag.lower() == "latest" else tag.upper()

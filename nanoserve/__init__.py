"""nanoserve: a small, readable LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.outputs import CompletionOutput, RequestOutput
    from nanoserve.sampling_params import SamplingParams

_LAZY = {
    "LLM": "nanoserve.entrypoints.llm",
    "CompletionOutput": "nanoserve.outputs",
    "RequestOutput": "nanoserve.outputs",
    "SamplingParams": "nanoserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    """Import on first use, so `import nanoserve` (and the CLI's --help) does not load torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")

"""nanoserve: a small, readable LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# How long torch's OpenMP threads spin after a parallel region before they sleep; read by
# libgomp when torch loads, so it is set here, before any nanoserve module imports torch (the
# spawned engine and API processes import nanoserve first too). libgomp's default, 300,000
# spins (milliseconds), assumes the cores are the team's alone; when they are not (the API
# process, a tokenizer, another program), a spinning thread burns the time slice that the
# thread it waits for needs, and every one of a step's ~150 regions can wait a slice. Measured
# on 2 cores with a second program's load (load average ~3.5), `bench serve --concurrency 1`:
# 2.7-4.0 tok/s and ITL p90 0.8-1.2 s at the default and at 100,000 spins, 20.7 at 10,000,
# 47.4 (ITL p90 22 ms) at 1,000, 45.0 with OMP_WAIT_POLICY=PASSIVE; on a quieter machine
# `bench step` at 1,000 spins matched the default (batch 1, 8, 64, interleaved runs), where
# PASSIVE took batch 1 from 6.6 to 10-15 ms. libgomp itself spins 100 times when it knows the
# cores are oversubscribed. A user's own setting wins. Figures: docs/benchmarks.md.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

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

"""llama.cpp's samplers as request fields, in llama-server's names, for every body that takes
them: completions and chat completions (as llama-server's OpenAI routes read them beside
OpenAI's fields), `/infill`, and Ollama's `options` (Ollama's own `typical_p`, `mirostat*` and
`repeat_last_n`, and llama-server's names beside them for the samplers Ollama lacks).

Absent fields stay off; the ones a request sets pass to SamplingParams as they are, which
checks each range and names the field (sampling_params.py). What each does and where it acts:
the sampler (nanoserve/sample/: dry.py, penalty_window.py, llama_draw.py).
"""

from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.serving.api_models import OpenAIModel, documented
from nanoserve.sampling_params import MAX_FLOAT32, MAX_INT64

LLAMA_SAMPLER_FIELDS = (
    "repeat_last_n", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
    "mirostat", "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")


class LlamaSamplerFields(OpenAIModel):
    """The fields, None where the request leaves them out (llama-server's defaults then)."""

    # the penalties over the last N tokens of prompt and output (-1: all of it; 0: none)
    repeat_last_n: int | None = documented(None, minimum=-1, maximum=MAX_INT64)
    typical_p: float | None = documented(None, exclusiveMinimum=0, maximum=1)
    top_n_sigma: float | None = documented(None, maximum=MAX_FLOAT32)  # <= 0: off
    xtc_probability: float | None = documented(None, minimum=0, maximum=1)
    xtc_threshold: float | None = documented(None, minimum=0, maximum=1)
    mirostat: int | None = documented(None, enum=[0, 1, 2])
    mirostat_tau: float | None = documented(None, minimum=0, maximum=MAX_FLOAT32)
    mirostat_eta: float | None = documented(None, minimum=0, maximum=MAX_FLOAT32)
    dry_multiplier: float | None = documented(None, minimum=0, maximum=MAX_FLOAT32)
    dry_base: float | None = documented(None, minimum=1, maximum=MAX_FLOAT32)
    dry_allowed_length: int | None = documented(None, minimum=0, maximum=MAX_INT64)
    dry_penalty_last_n: int | None = documented(None, minimum=-1, maximum=MAX_INT64)
    dry_sequence_breakers: list[str] | None = None


def llama_samplers(fields: LlamaSamplerFields) -> dict[str, Any]:
    """The fields the request set, by name (SamplingParams' keyword arguments)."""
    return {name: value for name in LLAMA_SAMPLER_FIELDS
            if (value := getattr(fields, name)) is not None}


# the penalties' window where llama-server (`/infill`) and Ollama leave it out: their default
LLAMA_PENALTY_WINDOW = 64


def with_llama_defaults(samplers: dict[str, Any]) -> dict[str, Any]:
    """`samplers` over llama-server's and Ollama's default for what vLLM has no default for:
    the penalties look at the last 64 tokens (read only with a penalty)."""
    return {"repeat_last_n": LLAMA_PENALTY_WINDOW, **samplers}

"""llama-server's `/infill` body: its field names, its defaults where a field is absent (they
differ from OpenAI's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), the fields editors
send (llama.vscode: `n_indent`, `t_max_predict_ms`, `samplers`, `cache_prompt`,
`response_fields`). Unknown fields are ignored, as llama-server ignores them; a sampler this
server does not run (dynamic temperature, `n_probs`), set to anything but its off value, is a
400 naming it (serving checks `unsupported_samplers`); llama.cpp's samplers are run
(llama_sampler_fields.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from nanoserve.entrypoints.serving.api_models import OpenAIModel, ResponseModel, documented
from nanoserve.entrypoints.serving.llama_sampler_fields import LlamaSamplerFields
from nanoserve.sampling_params import MAX_INT64

_MIXED: dict[str, Any] = {"anyOf": [{"type": "string"},
                    {"type": "array", "items": {"anyOf": [
                        {"type": "string"}, {"type": "integer", "minimum": 0}]}}]}


class ExtraChunk(OpenAIModel):
    """A file beside the one edited: its text, and its name (llama-server's default "tmp")."""

    text: str
    filename: str = "tmp"


class InfillRequest(LlamaSamplerFields):
    model: str | None = None
    input_prefix: str | list[str | int] = Field(json_schema_extra=_MIXED)
    input_suffix: str | list[str | int] = Field(json_schema_extra=_MIXED)
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # where the middle starts (after the prefix)
    n_predict: int = documented(-1, minimum=-1, maximum=MAX_INT64)  # -1: up to the context
    temperature: float = documented(0.8, minimum=0)
    top_k: int = documented(40, minimum=0)  # 0: off
    top_p: float = documented(0.95, minimum=0, maximum=1)
    min_p: float = documented(0.05, minimum=0, maximum=1)
    seed: int = documented(-1, minimum=-1, maximum=2**32 - 1)  # -1: random
    stop: list[str] = Field(default_factory=list)
    presence_penalty: float = documented(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = documented(0.0, minimum=-2, maximum=2)
    ignore_eos: bool = False
    stream: bool = False
    # stop once a new line is indented less than this many spaces or tabs (the line cut off)
    n_indent: int = documented(0, minimum=0)
    # stop at the first new line after generating this long (ms since the first token; 0: off)
    t_max_predict_ms: int = documented(0, minimum=0)
    return_tokens: bool = False
    response_fields: list[str] | None = None  # only these fields ("a/b": nested) in the reply
    repeat_penalty: float = documented(1.0, exclusiveMinimum=0)  # vLLM's repetition_penalty
    # accepted as llama-server does: the prefix cache is always on here, and the sampler
    # chain's order is this server's (`samplers` is not read: sampling_params.py's order)
    cache_prompt: bool = True
    samplers: list[str] | str | None = None
    id_slot: int | None = None
    # llama-server's, not run here: their off values (anything else is a 400)
    dynatemp_range: float = 0.0
    n_probs: int = 0


def unsupported_samplers(req: InfillRequest) -> list[tuple[str, Any]]:
    """The settings `req` turns on that this server does not run: (field, value)."""
    on = [("dynatemp_range", req.dynatemp_range, req.dynatemp_range != 0.0),
          ("n_probs", req.n_probs, req.n_probs > 0)]
    return [(name, value) for name, value, is_on in on if is_on]


class InfillTimings(ResponseModel):
    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


class InfillResponse(ResponseModel):
    """POST /infill without `stream` (with it: `data:` events, the last with `stop: true`).
    `response_fields` keeps only the fields it names, so each may be absent."""

    content: str | None = None
    tokens: list[int] | None = None
    stop: bool | None = None
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    prompt: str | None = None
    stop_type: str | None = None
    stopping_word: str | None = None
    timings: InfillTimings | None = None

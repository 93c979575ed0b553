"""llama-server's `/infill` body: its field names, its defaults where a field is absent (they
differ from OpenAI's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), the fields editors
send (llama.vscode: `n_indent`, `t_max_predict_ms`, `samplers`, `cache_prompt`,
`response_fields`). Unknown fields are ignored, as llama-server ignores them; a sampler this
server does not run yet, set to anything but its off value, is a 400 naming it (serving
checks `unsupported_samplers`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from nanoserve.entrypoints.serving.api_models import OpenAIModel, ResponseModel, documented
from nanoserve.sampling_params import MAX_INT64

_MIXED: dict[str, Any] = {"anyOf": [{"type": "string"},
                    {"type": "array", "items": {"anyOf": [
                        {"type": "string"}, {"type": "integer", "minimum": 0}]}}]}


class ExtraChunk(OpenAIModel):
    """A file beside the one edited: its text, and its name (llama-server's default "tmp")."""

    text: str
    filename: str = "tmp"


class InfillRequest(OpenAIModel):
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
    # accepted as llama-server does: the prefix cache is always on here, and the sampler chain
    # is this server's (top-k, top-p, min-p, temperature)
    cache_prompt: bool = True
    samplers: list[str] | str | None = None
    id_slot: int | None = None
    # llama-server's samplers not run here yet: their off values (anything else is a 400)
    repeat_penalty: float = 1.0
    typical_p: float = 1.0
    mirostat: int = 0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    top_n_sigma: float = -1.0
    dynatemp_range: float = 0.0
    n_probs: int = 0


def unsupported_samplers(req: InfillRequest) -> list[tuple[str, Any]]:
    """The samplers `req` turns on that this server does not run yet: (field, value)."""
    on = [("repeat_penalty", req.repeat_penalty, req.repeat_penalty != 1.0),
          ("typical_p", req.typical_p, req.typical_p < 1.0),
          ("mirostat", req.mirostat, req.mirostat != 0),
          ("dry_multiplier", req.dry_multiplier, req.dry_multiplier != 0.0),
          ("xtc_probability", req.xtc_probability, req.xtc_probability > 0.0),
          ("top_n_sigma", req.top_n_sigma, req.top_n_sigma >= 0.0),
          ("dynatemp_range", req.dynatemp_range, req.dynatemp_range != 0.0),
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

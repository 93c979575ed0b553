"""Response bodies of Ollama's API, as pydantic models for the OpenAPI document only (the
handlers build dicts; tests/entrypoints/test_openapi_fuzz.py checks what they answer against
these). A field without a default is always present; extra keys are allowed."""

from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.serving.api_models import ResponseModel


class OllamaErrorResponse(ResponseModel):
    """Every 4xx and 5xx on `/api/`: Ollama's error object."""

    error: str


class OllamaVersion(ResponseModel):
    version: str


class OllamaModelDetails(ResponseModel):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaListedModel(ResponseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaTags(ResponseModel):
    models: list[OllamaListedModel]


class OllamaRunningModel(ResponseModel):
    name: str
    model: str
    size: int
    digest: str
    details: OllamaModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class OllamaRunning(ResponseModel):
    models: list[OllamaRunningModel]


class OllamaShow(ResponseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaCallFunctionOut(ResponseModel):
    name: str
    arguments: dict[str, Any]


class OllamaToolCallOut(ResponseModel):
    function: OllamaCallFunctionOut


class OllamaMessageOut(ResponseModel):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaToolCallOut] | None = None


class _Reply(ResponseModel):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None  # "stop", "length"; "load" or "unload" with nothing asked
    total_duration: int | None = None  # nanoseconds, as every duration here
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatReply(_Reply):
    """The answer with `stream: false`; streamed, each NDJSON line has this shape."""

    message: OllamaMessageOut


class OllamaGenerateReply(_Reply):
    """The answer with `stream: false`; streamed, each NDJSON line has this shape."""

    response: str
    thinking: str | None = None


class OllamaEmbedReply(ResponseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingReply(ResponseModel):
    embedding: list[float]

"""Request bodies of Ollama's API (its docs/api.md), as pydantic checks their shapes.

Only shapes and types are checked here; values are checked where they are used, by the same
code as on the OpenAI routes, with 400s that name the field. Unknown fields are accepted and
ignored, as Ollama does (a newer client's fields must not break an older server). `model` is
required, as Ollama's own server requires it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from nanoserve.entrypoints.serving.api_models import OpenAIModel, documented
from nanoserve.entrypoints.serving.llama_sampler_fields import LlamaSamplerFields

# keep_alive: a Go duration string or a number of seconds (keep_alive.py checks the value)
_KEEP_ALIVE: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "number"},
                                         {"type": "null"}]}
# format: "json", "" (none), or a JSON schema object
_FORMAT: dict[str, Any] = {"anyOf": [{"type": "string", "enum": ["", "json"]},
                                     {"type": "object"}, {"type": "null"}]}
_THINK: dict[str, Any] = {"anyOf": [{"type": "boolean"},
                                    {"type": "string", "enum": ["high", "medium", "low"]},
                                    {"type": "null"}]}


class OllamaOptions(LlamaSamplerFields):
    """`options`: the sampling ones Ollama documents (its `typical_p`, `mirostat*` and
    `repeat_last_n` among llama.cpp's samplers, whose other llama-server names are taken too);
    those this server does not implement are accepted at their neutral value and refused
    otherwise (`sampling_options.py`). Others, such as `num_gpu` or `num_thread`, set up
    Ollama's runner and are accepted and ignored here: the model is loaded already."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    num_predict: int | None = None  # -1 or -2: up to the context; else a cap on the output
    stop: list[str] | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = documented(None, minimum=1)
    # not implemented: accepted at their neutral values only (sampling_options.py)
    tfs_z: float | None = None
    penalize_newline: bool | None = None
    num_keep: int | None = None  # nothing is shifted out of the context here to keep


class OllamaFunction(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(OpenAIModel):
    type: str = "function"
    function: OllamaFunction


class OllamaCallFunction(OpenAIModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # Ollama sends an object


class OllamaToolCall(OpenAIModel):
    id: str | None = None
    function: OllamaCallFunction


class OllamaMessage(OpenAIModel):
    role: str
    content: str | None = None
    images: list[str] | None = None  # base64 (chat_request.py: image parts after the text)
    tool_calls: list[OllamaToolCall] | None = None
    thinking: str | None = None  # an assistant's earlier reasoning
    tool_name: str | None = None  # a tool result: the function it answers
    tool_call_id: str | None = None


class _GenerateFields(OpenAIModel):
    model: str | None = None  # required: checked by the handler, as a 400 naming it
    format: str | dict[str, Any] | None = Field(None, json_schema_extra=_FORMAT)
    options: OllamaOptions | None = None
    stream: bool = True
    think: bool | str | None = Field(None, json_schema_extra=_THINK)
    keep_alive: str | float | None = Field(None, json_schema_extra=_KEEP_ALIVE)


class OllamaChatRequest(_GenerateFields):
    """POST /api/chat."""

    messages: list[OllamaMessage] | None = None  # none or empty: only "load" the model
    tools: list[OllamaTool] | None = None


class OllamaGenerateRequest(_GenerateFields):
    """POST /api/generate."""

    prompt: str | None = None  # none or empty: only "load" the model
    suffix: str | None = None  # a fill-in-the-middle prompt (the model's FIM tokens)
    system: str | None = None
    template: str | None = None  # refused (Go templates; the model's own template is used)
    raw: bool = False
    images: list[str] | None = None  # base64, as a message's; refused with raw
    context: list[int] | None = None  # accepted and ignored (deprecated by Ollama)


class OllamaEmbedRequest(OpenAIModel):
    """POST /api/embed."""

    model: str | None = None
    input: str | list[str] = ""
    truncate: bool = True  # an input past the context is cut to fit, as Ollama does
    options: OllamaOptions | None = None
    keep_alive: str | float | None = Field(None, json_schema_extra=_KEEP_ALIVE)
    dimensions: int | None = documented(None, minimum=1)


class OllamaEmbeddingsRequest(OpenAIModel):
    """POST /api/embeddings (Ollama's older embedding route: one prompt, one vector)."""

    model: str | None = None
    prompt: str = ""
    options: OllamaOptions | None = None
    keep_alive: str | float | None = Field(None, json_schema_extra=_KEEP_ALIVE)


class OllamaShowRequest(OpenAIModel):
    """POST /api/show (`name` is the older spelling of `model`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False

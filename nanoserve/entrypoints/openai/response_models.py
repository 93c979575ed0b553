"""Response bodies of the API, as pydantic models for the OpenAPI document only.

The handlers build their JSON as dicts (one place per shape, in serving_*.py); these models
describe that JSON so /openapi.json is accurate, and the schemathesis test
(tests/entrypoints/test_openapi_fuzz.py) checks every response it provokes against them. A field
without a default is always present (possibly null); one with a default may be left out.
Extra keys are allowed, as in OpenAI's own schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, RootModel

from nanoserve.entrypoints.serving.api_models import ResponseModel

# "abort": stopped by the server (shutdown); "error": the engine could not go on with this
# request (its grammar failed to compile, or refused a token its own mask allowed)
FinishReason = Literal["stop", "length", "abort", "error"]


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None  # the stop token id or string that ended it (vLLM)


class CompletionResponse(ResponseModel):
    """POST /v1/completions without `stream` (with it: `text/event-stream` chunks)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's name)
    reasoning_content: str | None = None  # the same text under its older name
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | Literal["tool_calls"]
    stop_reason: int | str | None


class ChatCompletionResponse(ResponseModel):
    """POST /v1/chat/completions without `stream` (with it: `text/event-stream` chunks)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    # what a prompt may hold: ["text"], or ["text", "image"] for a model with a vision tower
    # (OpenRouter's and models.dev's name, which clients read to offer an image upload)
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str


class RenderResponse(ResponseModel):
    """/v1/chat/completions/render: the ids the request would prefill (what routers hash)."""

    token_ids: list[int]


class CompletionRenderResponse(RootModel[list[RenderResponse]]):
    """/v1/completions/render: one entry per prompt of the batch."""


class KVEventSourceResponse(ResponseModel):
    """One engine core's entry in /kv_event_sources (vllm-router's `KvEventSourceEntry`)."""

    endpoint: str  # the PUB socket; a bind address (tcp://*:5557) means this host
    replay_endpoint: str | None
    topic: str
    hwm: int
    buffer_steps: int
    publisher: Literal["zmq"]
    encoding: Literal["msgpack"]
    schema_version: Literal[1]
    enable_kv_cache_events: bool


class KVEventSourcesResponse(RootModel[dict[str, KVEventSourceResponse]]):
    """/kv_event_sources: an entry per data-parallel engine core, keyed by its rank ("0", ...)."""


class ServerInfoResponse(ResponseModel):
    """/get_server_info: what vllm-router's worker discovery reads (its `ServerInfo`)."""

    model_id: str  # the name requests send
    model_path: str
    instance_id: str  # new at each engine start
    kv_block_size: int
    effective_attention_block_size: int
    worker_type: Literal["regular"]  # neither a prefill nor a decode worker
    max_model_len: int
    version: str
    cpu_isa: str  # the CPU kernels' tier (avx2, avx512), "" where none run (a GPU model)
    kernel_schedule: str  # their schedule as tuned on this CPU (--kernel-tuning), "" where none

"""Request and response bodies of the pooling endpoints: OpenAI's embeddings, Jina's / Cohere's
rerank, vLLM's score.

Only shapes and types are checked by pydantic; the serving modules check values, with errors
that name the field (an input's index included). The ranges are documented (`documented`) so
/openapi.json states them. Unknown fields are accepted and ignored, as elsewhere.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from nanoserve.entrypoints.openai.protocol import OpenAIModel, documented
from nanoserve.entrypoints.serving.api_models import ResponseModel

_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_INPUT_SCHEMA: dict[str, Any] = {"anyOf": [
    _TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]}
_TEXTS_SCHEMA: dict[str, Any] = {"anyOf": [_TEXT, {"type": "array", "minItems": 1,
                                                   "items": _TEXT}]}
_DOCUMENT_SCHEMA: dict[str, Any] = {"anyOf": [
    _TEXT, {"type": "object", "required": ["text"], "properties": {"text": _TEXT}}]}


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings (OpenAI's fields)."""

    input: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=_INPUT_SCHEMA)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # only the model's own size: none of the served models is trained for shorter vectors
    dimensions: int | None = documented(None, minimum=1)
    user: str | None = None


class TextDocument(OpenAIModel):
    text: str


class RerankRequest(OpenAIModel):
    """POST /v1/rerank and /rerank (Jina's and Cohere's fields)."""

    query: str = documented(..., minLength=1)
    documents: list[str | TextDocument] = Field(
        json_schema_extra={"type": "array", "minItems": 1, "items": _DOCUMENT_SCHEMA})
    model: str | None = None
    top_n: int | None = documented(None, minimum=1)  # None: every document
    return_documents: bool = True


class ScoreRequest(OpenAIModel):
    """POST /score (vLLM's fields): one text against many, or pairs of equal-length lists."""

    text_1: str | list[str] = Field(json_schema_extra=_TEXTS_SCHEMA)
    text_2: str | list[str] = Field(json_schema_extra=_TEXTS_SCHEMA)
    model: str | None = None


# -- responses (for /openapi.json; the handlers build dicts) ------------------------------------
class EmbeddingData(ResponseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class PoolingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None  # with return_documents


class RerankResponse(ResponseModel):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: PoolingUsage


class ScoreData(ResponseModel):
    object: Literal["score"]
    index: int
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage

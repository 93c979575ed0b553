"""The server's context for request handlers: the engine, the tokenizer, the server's options,
and the checks every generating request makes first (the model's name, the capacity)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanoserve.entrypoints.serving.async_engine import AsyncEngine
from nanoserve.entrypoints.serving.errors import APIError, bad_request
from nanoserve.entrypoints.serving.limits import check_n
from nanoserve.entrypoints.serving.metrics import Metrics
from nanoserve.entrypoints.serving.model_names import ModelNames
from nanoserve.model.fim_tokens import FimTokens
from nanoserve.parsers.harmony import is_harmony_parser
from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.logits_processor import LogitsProcessor
from nanoserve.server_config import RequestLimits
from nanoserve.structured.grammar import GrammarTokenizer


@dataclass
class ServerContext:
    """Everything a request handler needs, built once when the server starts."""

    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: Metrics
    max_logprobs: int  # the engine's cap (EngineArgs.max_logprobs)
    max_in_flight: int  # past this many sequences (requests times n) in flight: 429
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # what `tool_choice="auto"` reads (parsers/tool_format)
    template_reads_tools: bool = True  # False: tools go in the system message (tool_prompt.py)
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's own
    processor_classes: list[type[LogitsProcessor]] = field(default_factory=list)
    reasoning_tokens: ReasoningTokens | None = None  # the model's `<think>`, `</think>` ids
    # the model's tokenizer as llguidance's, for the grammar checks (built on first use)
    grammar_tokenizer: GrammarTokenizer | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    # the model has a vision tower: image parts reach its template (else any image is a 400,
    # vLLM's "At most 0 image(s) ..."); set from the model at start-up
    accepts_images: bool = False
    # its image processor (model/vision/): an image's pixels and placeholder tokens
    image_processor: Any = None
    model_path: str = ""  # the checkpoint served (--model), for /get_server_info
    instance_id: str = ""  # this server's id for routers: one per engine start (router_info.py)
    # where each engine core publishes KV-cache events, for /kv_event_sources (none: 404)
    kv_event_sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    shutting_down: bool = False
    # the names the model answers to (model_names.py); None: its name and model_path's
    names: ModelNames | None = None
    fim_tokens: FimTokens = field(default_factory=FimTokens)  # the model's; none: no infill

    def __post_init__(self) -> None:
        if self.reasoning_parser is None and self.tool_call_parser == "openai":
            # harmony's channels are one format: its tool-call parser (chosen from the
            # template, parsers/tool_format.py) brings its reasoning parser
            self.reasoning_parser = "openai_gptoss"
        if self.names is None:
            self.names = ModelNames({self.model_name: self.model_path or None})

    @property
    def input_modalities(self) -> list[str]:
        """What a prompt may hold, as /v1/models tells clients."""
        return ["text", "image"] if self.accepts_images else ["text"]

    @property
    def is_harmony(self) -> bool:
        """gpt-oss's harmony format: its parsers read reasoning and calls together."""
        return is_harmony_parser(self.tool_call_parser) or is_harmony_parser(self.reasoning_parser)

    @property
    def has_reasoning_tokens(self) -> bool:
        return self.reasoning_tokens is not None

    @property
    def has_chat_template(self) -> bool:
        """True when chat messages can be rendered: --chat-template, or the model's own."""
        return self.chat_template is not None or bool(getattr(self.tokenizer, "chat_template",
                                                              None))

    def check_model(self, model: str | None) -> None:
        """A 404 in OpenAI's words for a name the model does not answer to (none: the model)."""
        if model is not None and not self.answers_to(model):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def answers_to(self, model: str) -> bool:
        assert self.names is not None
        return self.names.resolve(model) is not None

    def check_capacity(self, num_prompts: int = 1, n: int = 1) -> None:
        """429 past the in-flight cap (the SDK backs off and retries); 503 while stopping.
        The cap counts engine sequences: each of a /v1/completions batch's prompts, times n
        (each sample holds its own copy of the prompt: 512 requests of n=128 on 8k-token
        prompts would need ~24 GiB in the engine alone)."""
        if self.engine.is_dead:
            raise APIError(503, "the engine is not running")
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        self.check_request_size(num_prompts, n)
        if self.engine.num_sequences_in_flight + num_prompts * n > self.max_in_flight:
            raise APIError(429, f"the server is at capacity ({self.max_in_flight} sequences "
                                "in flight); retry later")

    def check_request_size(self, num_prompts: int = 1, n: int = 1) -> None:
        """400 for a request larger than the server ever admits, whatever is in flight (the
        render endpoints check this much: they admit nothing)."""
        if num_prompts > self.max_in_flight:
            raise bad_request(f"prompt must be a batch of at most {self.max_in_flight} prompts "
                              f"(--max-in-flight), got {num_prompts}", "prompt")
        check_n(self.limits, n)
        if num_prompts * n > self.max_in_flight:
            raise bad_request(f"n times the prompts must be at most {self.max_in_flight} "
                              f"sequences (--max-in-flight), got {n} x {num_prompts}", "n")

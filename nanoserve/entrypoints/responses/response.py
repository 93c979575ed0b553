"""The response object of the Responses API: its status from the engine's finish reason, its
usage, and what it repeats of the request. Built once per response (`ResponseFrame`), then
written out with the output so far: empty in `response.created`, whole at the end."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nanoserve.entrypoints.responses.items import OutputItems
from nanoserve.entrypoints.responses.protocol import ResponsesRequest
from nanoserve.sampling_params import SamplingParams

_FAILED = {"abort": "the server stopped this response (it is shutting down)",
           "error": "the engine could not go on with this response"}


@dataclass(frozen=True)
class Outcome:
    """How a response ended: `status`, and why it is not `completed`."""

    status: str  # "completed" | "incomplete" | "failed"
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None


def outcome(finish_reason: str | None) -> Outcome:
    """The engine's finish reason as a response status: "length" (max_output_tokens, or the
    context filled up) is incomplete, as OpenAI's API says; "abort" and "error" failed."""
    if finish_reason == "length":
        return Outcome("incomplete", {"reason": "max_output_tokens"})
    if finish_reason in _FAILED:
        return Outcome("failed", error={"code": "server_error",
                                        "message": _FAILED[finish_reason]})
    return Outcome("completed")


def response_usage(num_input: int, num_output: int, num_cached: int,
                   num_reasoning: int) -> dict[str, Any]:
    """OpenAI's Responses usage; `num_cached`: prompt tokens the prefix cache served."""
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_input + num_output}


@dataclass(frozen=True)
class ResponseFrame:
    """A response's id and the fields that do not depend on its output."""

    model: str
    echoed: dict[str, Any]  # what the response repeats of the request
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, model: str, req: ResponsesRequest, params: SamplingParams) -> ResponseFrame:
        """The frame of `req`'s response; the sampling fields as the engine runs them."""
        reasoning = req.reasoning or {}
        text_format = req.text.format if req.text is not None else None
        return cls(model, {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": False,  # stateless: nothing is kept, whatever the request asked
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "background": False})

    def body(self, status: str, items: OutputItems | None = None,
             usage: dict[str, Any] | None = None, ended: Outcome | None = None
             ) -> dict[str, Any]:
        """The response object with the output so far (`status` "in_progress" while running)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.model, "status": status,
                "incomplete_details": ended.incomplete_details if ended else None,
                "error": ended.error if ended else None,
                "output": [] if items is None else items.items,
                "output_text": "" if items is None else items.output_text,
                "usage": usage, **self.echoed}

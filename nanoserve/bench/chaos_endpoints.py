"""The generating routes `nanoserve bench chaos` spreads its clients over, each as a body to send
and a reader of its answer: the text, the finish (as chat completions names it: "length" at the
token limit, "stop" otherwise) and, for a stream, when it is complete. Every body is greedy
with EOS ignored (`ignore_eos` is vLLM's extra field, which every route takes), so a finished
answer has one right text whatever the route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("completions", "chat", "messages", "responses")


@dataclass
class Piece:
    """What one answer, or one event of a stream, says."""

    text: str = ""
    finish_reason: str | None = None
    is_done: bool = False  # the stream's last event
    error: str | None = None


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    common = {"model": model, "temperature": 0.0, "ignore_eos": True}
    if endpoint == "completions":
        return {**common, "prompt": prompt, "max_tokens": max_tokens}
    message = [{"role": "user", "content": prompt}]
    if endpoint == "chat":
        return {**common, "messages": message, "max_tokens": max_tokens}
    if endpoint == "messages":
        return {**common, "messages": message, "max_tokens": max_tokens}
    return {**common, "input": prompt, "max_output_tokens": max_tokens}


def path(endpoint: str) -> str:
    return {"completions": "/v1/completions", "chat": "/v1/chat/completions",
            "messages": "/v1/messages", "responses": "/v1/responses"}[endpoint]


def read_answer(endpoint: str, body: dict[str, Any]) -> Piece:
    """A whole (non-streamed) answer."""
    if endpoint == "completions":
        choice = body["choices"][0]
        return Piece(choice["text"], choice["finish_reason"], True)
    if endpoint == "chat":
        choice = body["choices"][0]
        return Piece(choice["message"]["content"] or "", choice["finish_reason"], True)
    if endpoint == "messages":
        text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
        return Piece(text, _messages_finish(body["stop_reason"]), True)
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    return Piece(text, _responses_finish(body), True)


def read_event(endpoint: str, event: dict[str, Any]) -> Piece:
    """One event of a stream (chat completions' `[DONE]` is read by the caller)."""
    if "error" in event and endpoint in ("completions", "chat"):
        return Piece(error=str(event["error"]))
    if endpoint == "completions":
        choice = event["choices"][0] if event["choices"] else {}
        return Piece(choice.get("text") or "", choice.get("finish_reason"))
    if endpoint == "chat":
        choice = event["choices"][0] if event["choices"] else {}
        delta = choice.get("delta") or {}
        return Piece(delta.get("content") or "", choice.get("finish_reason"))
    kind = event.get("type")
    if kind == "error":
        return Piece(error=str(event.get("error") or event))
    if endpoint == "messages":
        if kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
            return Piece(event["delta"]["text"])
        if kind == "message_delta":
            return Piece(finish_reason=_messages_finish(event["delta"]["stop_reason"]))
        return Piece(is_done=kind == "message_stop")
    if kind == "response.output_text.delta":
        return Piece(event["delta"])
    if kind in ("response.completed", "response.incomplete", "response.failed"):
        return Piece(finish_reason=_responses_finish(event["response"]), is_done=True)
    return Piece()


def _messages_finish(stop_reason: str | None) -> str | None:
    return None if stop_reason is None else "length" if stop_reason == "max_tokens" else "stop"


def _responses_finish(response: dict[str, Any]) -> str | None:
    if response["status"] == "completed":
        return "stop"
    details = response.get("incomplete_details") or {}
    return "length" if details.get("reason") == "max_output_tokens" else response["status"]

"""Ollama's reply objects, shared by the whole answer and the stream: the head every object
starts with, the text of a chat (`message`) or a generate (`response`), and the final object's
`done_reason` and timings.

Timings are nanoseconds, as Ollama's: `total_duration` from the request's arrival to its end;
`load_duration` until the engine had it (the checks, the template, the tokenizer: the model is
loaded when the server starts); `prompt_eval_duration` from then to the first output token;
`eval_duration` from the first output token to the last (at least 1, since clients divide
`eval_count` by it). `prompt_eval_count` is the whole prompt, the prefix cache's share too (the
figure clients read as the context used); `eval_count` the output's tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from nanoserve.entrypoints.ollama.model_card import rfc3339
from nanoserve.outputs import RequestMetrics


@dataclass(frozen=True)
class ReplyShape:
    """Where one request's reply puts its text: `is_chat` in `message`, else in `response`."""

    model: str  # as the request named it, as Ollama echoes it
    is_chat: bool
    started: float  # time.monotonic() when the request arrived

    def head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": rfc3339(time.time())}

    def body(self, content: str, thinking: str = "",
             calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"message": message}
        body: dict[str, Any] = {"response": content}
        if thinking:
            body["thinking"] = thinking
        return body

    def empty(self, done_reason: str) -> dict[str, Any]:
        """The answer to a request with nothing to generate ("load" or "unload")."""
        return {**self.head(), **self.body(""), "done": True, "done_reason": done_reason}

    def final(self, finish_reason: str | None, metrics: RequestMetrics | None,
              num_prompt: int, num_output: int) -> dict[str, Any]:
        """`done`, `done_reason` and the timings (see the module)."""
        now = time.monotonic()
        arrival = first = last = now
        if metrics is not None:
            arrival = metrics.arrival_time
            first = metrics.first_token_time or now
            last = metrics.last_token_time or first
        return {"done": True, "done_reason": "length" if finish_reason == "length" else "stop",
                "total_duration": _ns(now - self.started),
                "load_duration": _ns(arrival - self.started),
                "prompt_eval_count": num_prompt,
                "prompt_eval_duration": _ns(first - arrival),
                "eval_count": num_output, "eval_duration": max(1, _ns(last - first))}


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """A parsed call as Ollama shapes it: the arguments as an object ({} where the text is no
    JSON object: a call cut off by the output's cap)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = {}
    return {"function": {"name": name, "arguments": value if isinstance(value, dict) else {}}}


def ndjson(body: dict[str, Any]) -> str:
    """One line of a stream (`application/x-ndjson`)."""
    return json.dumps(body, ensure_ascii=False) + "\n"


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))

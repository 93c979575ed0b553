"""Ollama's `num_predict` and `num_ctx` as caps on one request's output: the values no request
may take refused here, before any work; the caps themselves are the one max-tokens policy
(serving/token_limits.py), which chat_request.py hands them to.

`num_predict` caps the output, as Anthropic's `max_tokens` does here: Ollama stops at the
context's end whatever was asked, so a cap past the room the prompt leaves is held to that
room (done_reason "length"), not refused as chat completions' `max_tokens` is. -1 (no cap)
and -2 (fill the context) both mean up to the context; 0 and other negatives are a 400.

`num_ctx` sets the context a request gets. Ollama users set it by habit (2048, 8192, 32768),
and Ollama itself holds a value past the model's context to that context, so a larger one is
held to the server's `--max-model-len` without an error. A smaller one is a smaller context:
prompt plus output within it, and a prompt that does not fit it is a 400 naming the field
(Ollama would cut the conversation's oldest turns; this server does not drop what it was sent).
"""

from __future__ import annotations

from nanoserve.entrypoints.ollama.protocol import OllamaOptions
from nanoserve.entrypoints.serving.errors import bad_request

UP_TO_CONTEXT = (-1, -2)  # Ollama's num_predict for "no cap" and "fill the context"


def check_caps(options: OllamaOptions | None) -> None:
    """400s for values no request may take, before any work."""
    if options is None:
        return
    asked = options.num_predict
    if asked is not None and asked < 1 and asked not in UP_TO_CONTEXT:
        raise bad_request(f"options.num_predict must be >= 1, or -1 (no limit) or -2 (fill "
                          f"the context), got {asked}", "options.num_predict")
    if options.num_ctx is not None and options.num_ctx < 1:
        raise bad_request(f"options.num_ctx must be >= 1, got {options.num_ctx}",
                          "options.num_ctx")

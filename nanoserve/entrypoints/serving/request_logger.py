"""One log line per request as it is sent to the engine.

By default the line holds only what operating the server needs (the request id, its prompt's
size and the amount asked for). Prompts, stop strings and the other sampling parameters can hold
personal or secret text, and logs are kept longer and read by more people than requests are, so
they are logged only with `nanoserve serve --log-requests` (vLLM's `--enable-log-requests`).
"""

from __future__ import annotations

import logging

from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger("nanoserve.requests")


class RequestLogger:
    """Logs each request at INFO; `log_prompts` adds its prompt text, token ids and params."""

    def __init__(self, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts

    def log(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        if self.log_prompts:
            logger.info("request %s: %d prompt tokens, prompt=%r, prompt_token_ids=%s, "
                        "params=%r", request_id, len(prompt_token_ids), prompt,
                        prompt_token_ids, params)
        else:
            logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%s", request_id,
                        len(prompt_token_ids), params.n, params.max_tokens)

    def log_pooling(self, request_id: str, prompt_token_ids: list[int], task: str) -> None:
        """An embedding or score request: its size (and with `log_prompts` its ids)."""
        if not logger.isEnabledFor(logging.INFO):
            return
        if self.log_prompts:
            logger.info("request %s: %d prompt tokens, pooling %s, prompt_token_ids=%s",
                        request_id, len(prompt_token_ids), task, prompt_token_ids)
        else:
            logger.info("request %s: %d prompt tokens, pooling %s", request_id,
                        len(prompt_token_ids), task)

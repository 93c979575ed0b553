"""What generation returns to the user: vLLM's RequestOutput / CompletionOutput shapes, and
PoolingRequestOutput for prefill-only (embedding, scoring) requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanoserve.protocol import PromptProgress


@dataclass
class Logprob:
    """A token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: token id -> Logprob (the chosen token and the top-N alternatives)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (one of its `n` samples)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's prompt and its outputs so far (final once `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first token
    # how far the prompt is computed, when it asked (`return_progress`) and a prefill chunk ran
    # since the last update; a streamed update may carry only this (`outputs` empty)
    prompt_progress: PromptProgress | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's shape): an embedding (task "embed", L2-normalized
    unless asked otherwise) or the asked tokens' logits at the last prompt position ("score")."""

    data: np.ndarray  # [dimensions] or [len(logit_token_ids)], float32

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """A finished pooling request: its prompt and its one vector (no tokens are generated)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    finished: bool = True

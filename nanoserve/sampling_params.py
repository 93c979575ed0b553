"""SamplingParams: what a request asks of the sampler and the stop checks, with vLLM's defaults.

Every field is validated on construction, and a bad value raises ValueError naming the field,
the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM's names and defaults)."""

    temperature: float = 1.0  # 0 = greedy
    max_tokens: int | None = 16  # None = up to the model's context length
    ignore_eos: bool = False
    seed: int | None = None  # None = a fresh random seed per request
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

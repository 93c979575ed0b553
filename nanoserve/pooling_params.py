"""PoolingParams: what a prefill-only request asks of the engine instead of output tokens.

vLLM's `PoolingParams` shape, cut to what the engine does here. A request that carries them is
scheduled like a prompt (chunked prefill, beside decoding requests), samples nothing, and when
its prompt is done the worker returns one vector and the engine frees its blocks:

- task "embed": the final normed hidden state pooled over the prompt (the engine's `--pooling`:
  the last token's, or the mean of every token's), truncated to `dimensions` if given, and
  L2-normalized when `normalize`;
- task "score": the LM head's logits at the last prompt position for `logit_token_ids`, raw
  (a judging template's "yes" against "no", as Qwen3-Reranker scores).

Every field is validated on construction; a bad value raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLING_TASKS = ("embed", "score")


@dataclass
class PoolingParams:
    """Per-request pooling settings (vLLM's names)."""

    task: str = "embed"  # "embed" | "score"
    normalize: bool = True  # L2-normalize the pooled vector ("embed" only)
    dimensions: int | None = None  # keep the first `dimensions` values, then normalize
    logit_token_ids: list[int] | None = None  # "score": the tokens whose logits come back

    def __post_init__(self) -> None:
        _check(self.task in POOLING_TASKS, "task", self.task, f"one of {list(POOLING_TASKS)}")
        if self.dimensions is not None:
            _check(isinstance(self.dimensions, int) and self.dimensions >= 1, "dimensions",
                   self.dimensions, "an integer >= 1")
        if self.task == "score":
            ids = self.logit_token_ids
            _check(bool(ids) and all(isinstance(t, int) for t in ids or ()),
                   "logit_token_ids", ids, "a non-empty list of token ids for task 'score'")
        else:
            _check(self.logit_token_ids is None, "logit_token_ids", self.logit_token_ids,
                   "unset for task 'embed'")

    def check(self, hidden_size: int, vocab_size: int) -> None:
        """Refuse sizes the model cannot give, naming the field."""
        if self.dimensions is not None:
            _check(self.dimensions <= hidden_size, "dimensions", self.dimensions,
                   f"at most the model's embedding size ({hidden_size})")
        bad = [t for t in self.logit_token_ids or () if not 0 <= t < vocab_size]
        _check(not bad, "logit_token_ids", bad[:1], f"token ids in [0, {vocab_size})")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

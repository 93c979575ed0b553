"""What a request's sampling options must satisfy before a slot takes them, beyond their own
ranges (sampling_params.py) and the server's limits (`SamplingParams.check_limits`): the
custom processors' arguments, a thinking budget only where the model has reasoning tags, and
an `allowed_token_ids` that leaves something to draw.

One check, run by the engine core at admission, which holds no sampler (the sampler lives in
rank 0's worker, behind the executor seam), and by the sampler's own `validate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.sample.logits_processor import LogitsProcessor
from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingAdmission:
    """The checks for one model and one set of processor classes."""

    eos_token_ids: tuple[int, ...]
    has_reasoning_tokens: bool
    processor_classes: tuple[type[LogitsProcessor], ...] = ()

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field where a slot could not sample `params`."""
        for cls in self.processor_classes:
            cls.validate_params(params)
        if params.thinking_token_budget is not None and not self.has_reasoning_tokens:
            raise ValueError("thinking_token_budget needs a model with reasoning tags "
                             "(<think> and </think> tokens); this model has none")
        self._check_something_allowed(params)

    def _check_something_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids must keep a token that bad_words (one-token words) and, before
        min_tokens, the end-of-sequence and stop ids do not ban: else no draw is possible."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        allowed -= {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if not allowed:
            raise ValueError(f"allowed_token_ids={params.allowed_token_ids} are all banned by "
                             "bad_words; allow at least one other token")
        if params.min_tokens > 0:
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids |= set(self.eos_token_ids)
            if not allowed - stop_ids:
                raise ValueError(
                    f"allowed_token_ids={params.allowed_token_ids} leave only end-of-sequence or "
                    f"stop_token_ids, which min_tokens={params.min_tokens} bans; allow at least "
                    "one other token or set min_tokens=0")

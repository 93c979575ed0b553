"""A test double of the model runner that costs (almost) nothing: for frontend benchmarks.

It skips the model and hands the sampler precomputed logits whose argmax cycles through
ordinary tokens, so everything around the model (scheduler, sampler, process boundary, output
processing, HTTP) can be measured alone: `nanoserve serve --zero-cost-engine`.
"""

from __future__ import annotations

import torch

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import ScheduledRequest

_FIRST_TOKEN = 100  # past the special tokens of most vocabularies


class ZeroCostRunner:
    """Same `execute` contract as ModelRunner; the KV cache is still the real one's."""

    def __init__(self, real: ModelRunner, max_rows: int) -> None:
        self.device = real.device
        self.block_size = real.block_size
        self.kv_caches = real.kv_caches
        vocab = real.model.arch.vocab_size
        self.logits = torch.zeros(max_rows, vocab, device=real.device)
        rows = torch.arange(max_rows, device=real.device)
        self.logits[rows, _FIRST_TOKEN + rows % 1000] = 10.0  # a different token per row

    def release_slot(self, slot: int) -> None:
        pass  # no block table to keep

    def execute(self, scheduled: list[ScheduledRequest], block_ids: list[list[int]]
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        num_rows = sum(1 for s in scheduled if s.samples)
        return self.logits[:num_rows].clone(), {}  # the sampler edits its logits in place

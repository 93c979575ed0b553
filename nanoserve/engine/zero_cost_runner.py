"""A test double of the model runner that costs (almost) nothing: for frontend benchmarks.

It skips the model and hands the sampler precomputed logits whose argmax cycles through
ordinary tokens, so everything around the model (scheduler, sampler, process boundary, output
processing, HTTP) can be measured alone: `nanoserve serve --zero-cost-engine`.
"""

from __future__ import annotations

import torch

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.protocol import StepInput

_FIRST_TOKEN = 100  # past the special tokens of most vocabularies


class ZeroCostRunner:
    """Same `execute` contract as ModelRunner; the KV cache is still the real one's."""

    def __init__(self, real: ModelRunner, max_rows: int) -> None:
        self.device = real.device
        self.block_size = real.block_size
        self.kv_caches = real.kv_caches
        self.plan = real.plan  # never runs: the model is skipped
        vocab = real.model.arch.vocab_size
        self.hidden_size = real.model.arch.hidden_size
        self.logits = torch.zeros(max_rows, vocab, device=real.device)
        rows = torch.arange(max_rows, device=real.device)
        self.logits[rows, _FIRST_TOKEN + rows % 1000] = 10.0  # a different token per row

    def execute(self, step: StepInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        num_rows = len(step.logits_rows)
        prompt_logits = [self.logits[: len(e.target_token_ids)] for e in step.prompt_logprobs]
        return self.logits[:num_rows].clone(), prompt_logits  # the sampler edits it in place

    def execute_step(self, step: StepInput
                     ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """`execute`, and hidden states for pooling requests: every row the same unit vector."""
        logits, prompt_logits = self.execute(step)
        hidden = torch.zeros(step.num_tokens, self.hidden_size, device=self.device)
        hidden[:, 0] = 1.0
        return logits, prompt_logits, hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(hidden), self.logits.shape[1], device=self.device)

"""The sampler: per-slot state written once per request, one call per step for the whole batch.

This is the foundation the full pipeline (issue: batched sampler) grows on: greedy rows take the
argmax; temperature rows draw by Gumbel-max with counter-based noise (see noise.py), so a seeded
request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from nanoserve.sample.noise import uniform_noise
from nanoserve.sampling_params import SamplingParams


class Sampler:
    """Per-slot temperature and seed tensors; `sample` gathers the rows of the step."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.is_greedy_cpu = [True] * num_slots  # host copy: skip the draw when all are greedy

    def add_request(self, slot: int, params: SamplingParams, seed: int) -> None:
        """Write a request's parameters into its slot (on admission, once)."""
        self.temperature[slot] = params.temperature
        self.seed[slot] = seed - (1 << 64) if seed >= (1 << 63) else seed
        self.is_greedy_cpu[slot] = params.is_greedy

    def sample(self, logits: torch.Tensor, slots: list[int],
               output_positions: torch.Tensor) -> torch.Tensor:
        """Next token ids [R] for logits [R, vocab] of requests in `slots` at `output_positions`."""
        greedy = logits.argmax(dim=-1)
        if all(self.is_greedy_cpu[s] for s in slots):
            return greedy
        index = torch.tensor(slots, device=self.device)
        temperature = self.temperature[index]
        is_greedy = temperature == 0
        scaled = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
        uniforms = uniform_noise(self.seed[index], output_positions, logits.shape[-1])
        gumbel = -torch.log(-torch.log(uniforms))
        drawn = (scaled + gumbel).argmax(dim=-1)
        return torch.where(is_greedy, greedy, drawn)

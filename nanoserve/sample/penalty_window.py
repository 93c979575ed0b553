"""llama.cpp's penalties over a window of the last `repeat_last_n` tokens of prompt and output.

(Being written.)
"""

from __future__ import annotations

import torch

from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.state import SamplingState


def apply_penalty_window(logits: torch.Tensor, state: SamplingState,
                         batch: SamplingBatch) -> None:
    """Repetition, frequency and presence penalties over each row's window, in place."""
    rows = batch.rows(state.uses["penalty_window"])
    if len(rows):
        raise NotImplementedError("repeat_last_n")

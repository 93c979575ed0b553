"""DRY ("Don't Repeat Yourself"), llama.cpp's repetition penalty over repeated sequences.

(Being written: the stage is a no-op until it lands.)
"""

from __future__ import annotations

import torch

from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.state import SamplingState


def apply_dry(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch) -> None:
    """Penalize, in place, the tokens that would extend a repeat of the rows' history."""
    rows = batch.rows(state.uses["dry"])
    if len(rows):
        raise NotImplementedError("DRY")

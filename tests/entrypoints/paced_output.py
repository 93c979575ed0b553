"""A logits processor that takes a few milliseconds a step and changes no logit: a tiny
random-weight model writes its longest output in about a second, and a test that must stop a
server while a stream is still running needs the stream to outlast its signals. Load it with
`--logits-processors paced_output:PacedSteps` and this directory on PYTHONPATH."""

from __future__ import annotations

import time

import torch

from nanoserve.sample.logits_processor import LogitsProcessor, ProcessorBatch
from nanoserve.sample.sequence import SequenceData

STEP_PAUSE_S = 0.005  # a step: ~900 tokens take at least 4.5 s


class PacedSteps(LogitsProcessor):
    """Every step that samples a request pauses STEP_PAUSE_S; the logits stay as they are."""

    def add_request(self, seq: SequenceData) -> bool:
        return True

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        time.sleep(STEP_PAUSE_S)

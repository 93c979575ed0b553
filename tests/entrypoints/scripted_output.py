"""A logits processor that makes a model write a given text: how the server tests get a tiny
random model to emit tool calls, deterministically, through the real engine and server.

`extra_args={"scripted_token_ids": [...]}`: output token k is the k-th id (the others are
masked to -inf, so any temperature draws it); past the script the model runs freely. Load it
with `--logits-processors scripted_output:ScriptedOutput` and this directory on PYTHONPATH.
`ScriptedByDefault` also scripts the requests that carry no ids (APIs without `extra_args`:
Responses, Ollama) with the comma-separated ids of the server's SCRIPTED_TOKEN_IDS.
"""

from __future__ import annotations

import os

import torch

from nanoserve.sample.logits_processor import LogitsProcessor, ProcessorBatch
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams


class ScriptedOutput(LogitsProcessor):
    """Forces each scripted request's next token (see the module)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        script = (params.extra_args or {}).get("scripted_token_ids")
        if script is not None and not (isinstance(script, list)
                                       and all(isinstance(t, int) for t in script)):
            raise ValueError(f"extra_args['scripted_token_ids'] must be token ids, got {script!r}")

    def add_request(self, seq: SequenceData) -> bool:
        return (seq.params.extra_args or {}).get("scripted_token_ids") is not None

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        for row, seq in zip(batch.rows, batch.seqs, strict=True):
            script = (seq.params.extra_args or {})["scripted_token_ids"]
            position = len(seq.output_token_ids)
            if position < len(script):
                logits[row] = float("-inf")
                logits[row, script[position]] = 0.0


class ScriptedByDefault(ScriptedOutput):
    """ScriptedOutput, with SCRIPTED_TOKEN_IDS for a request that names no ids."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        super().__init__(num_slots, vocab_size, device)
        self.default = [int(t) for t in os.environ["SCRIPTED_TOKEN_IDS"].split(",")]

    def add_request(self, seq: SequenceData) -> bool:
        return True

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        for row, seq in zip(batch.rows, batch.seqs, strict=True):
            script = (seq.params.extra_args or {}).get("scripted_token_ids") or self.default
            position = len(seq.output_token_ids)
            if position < len(script):
                logits[row] = float("-inf")
                logits[row, script[position]] = 0.0

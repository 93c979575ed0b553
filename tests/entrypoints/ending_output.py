"""A logits processor that ends every output after a few free tokens: a tiny random-weight model
would otherwise write until max_tokens, and a client such as Claude Code retries an answer cut
off by max_tokens, then gives up. Load it with `--logits-processors ending_output:EndsSoon` and
this directory on PYTHONPATH; it acts on every request."""

from __future__ import annotations

import torch

from nanoserve.sample.logits_processor import LogitsProcessor, ProcessorBatch
from nanoserve.sample.sequence import SequenceData

NUM_FREE_TOKENS = 16
END_OF_TURN_ID = 2  # <|im_end|>: the SmolLM2 tokenizer's end of turn, the tiny models' EOS


class EndsSoon(LogitsProcessor):
    """After NUM_FREE_TOKENS sampled freely, the end of the turn."""

    end_of_turn_id = END_OF_TURN_ID

    def add_request(self, seq: SequenceData) -> bool:
        return True

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        for row, seq in zip(batch.rows, batch.seqs, strict=True):
            if len(seq.output_token_ids) >= NUM_FREE_TOKENS:
                logits[row] = float("-inf")
                logits[row, self.end_of_turn_id] = 0.0


class EndsSoonGemma(EndsSoon):
    """The same for Gemma 3, whose turn ends with <end_of_turn>."""

    end_of_turn_id = 106

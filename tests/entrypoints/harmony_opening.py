"""A logits processor that opens every output of a random-weight harmony model (gpt-oss, the
o200k_harmony tokenizer) with a short analysis message and the final channel's header, so that
the answer that follows is the final message: the grammar of a response format holds only that
message (`harmony_grammar.py`), and a random model left to itself writes its analysis until the
context is full. Past the opening the model runs freely. Load it with `--logits-processors
harmony_opening:HarmonyOpening` and this directory on PYTHONPATH; it acts on every request.
"""

from __future__ import annotations

import torch

from nanoserve.sample.logits_processor import LogitsProcessor, ProcessorBatch
from nanoserve.sample.sequence import SequenceData

OPENING = ("<|channel|>analysis<|message|>The user wants a short greeting.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>")


def opening_ids() -> list[int]:
    """OPENING in o200k_harmony's ids (its format tokens one id each)."""
    from transformers import AutoTokenizer

    from nanoserve.bench.o200k_harmony import harmony_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(harmony_tokenizer_dir())
    return list(tokenizer.encode(OPENING, add_special_tokens=False))


class HarmonyOpening(LogitsProcessor):
    """Output token k is OPENING's k-th id while there are ids left (see the module)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        super().__init__(num_slots, vocab_size, device)
        self.script = opening_ids()

    def add_request(self, seq: SequenceData) -> bool:
        return True

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        for row, seq in zip(batch.rows, batch.seqs, strict=True):
            position = len(seq.output_token_ids)
            if position < len(self.script):
                logits[row] = float("-inf")
                logits[row, self.script[position]] = 0.0

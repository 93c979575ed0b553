"""NoRepeatNGram: the worked example of a custom logits processor, shipped and registered.

Per request, `extra_args={"no_repeat_ngram_size": n}` (an integer >= 1) bans every token that
would complete an n-gram already present in the sequence (prompt and output), like
transformers' `no_repeat_ngram_size`. It stops the loops small models fall into ("the the the",
a repeated sentence) without the blunt, global effect of a repetition penalty.

Each request's n-grams are indexed incrementally: a step adds only the n-grams its new token
completes, then looks up the last n - 1 tokens. A draft row's pending tokens are never indexed:
the n-grams they complete are checked beside the index, for that row only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nanoserve.sample.logits_processor import LogitsProcessor, ProcessorBatch
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # an API process loads the class to check requests' arguments, no tensors
    import torch

ARG = "no_repeat_ngram_size"


class NoRepeatNGram(LogitsProcessor):
    """Bans tokens that would repeat an n-gram of the prompt or output."""

    supports_speculation = True

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        super().__init__(num_slots, vocab_size, device)
        self.size = [0] * num_slots
        self.num_indexed = [0] * num_slots  # tokens whose ending n-gram is indexed
        self.followers: list[dict[tuple[int, ...], set[int]]] = [{} for _ in range(num_slots)]

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        size: Any = (params.extra_args or {}).get(ARG)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 1):
            raise ValueError(f"extra_args['{ARG}'] must be an integer >= 1, got {size!r}")

    def add_request(self, seq: SequenceData) -> bool:
        slot = seq.slot
        size = (seq.params.extra_args or {}).get(ARG)
        self.size[slot] = size or 0
        self.num_indexed[slot] = 0
        self.followers[slot] = {}
        return bool(size)

    def remove_request(self, slot: int) -> None:
        self.followers[slot] = {}

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        num_pending = (batch.num_pending if batch.num_pending is not None
                       else [0] * len(batch.rows))
        for row, slot, seq, pending in zip(batch.rows, batch.slots, batch.seqs, num_pending,
                                           strict=True):
            banned = self._banned(int(slot), seq.prompt_token_ids, seq.output_token_ids,
                                  int(pending))
            ban_rows += [int(row)] * len(banned)
            ban_ids += banned
        from nanoserve.sample.stages import ban  # the engine's, with torch loaded already

        ban(logits, ban_rows, ban_ids)

    def _banned(self, slot: int, prompt: Sequence[int], output: Sequence[int],
                num_pending: int = 0) -> list[int]:
        """Tokens that would complete an n-gram of prompt + output; the last `num_pending`
        tokens of `output` are drafts: their n-grams count for this row and are not indexed."""
        n = self.size[slot]
        followers = self.followers[slot]
        num_tokens = len(prompt) + len(output)
        num_committed = num_tokens - num_pending
        for end in range(max(self.num_indexed[slot], n), num_committed + 1):
            gram = _window(prompt, output, end - n, end)
            followers.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        self.num_indexed[slot] = max(self.num_indexed[slot], num_committed + 1)
        if num_tokens < n - 1:
            return []
        context = tuple(_window(prompt, output, num_tokens - n + 1, num_tokens))
        banned = set(followers.get(context, ()))
        for end in range(max(num_committed + 1, n), num_tokens + 1):  # pending n-grams
            gram = _window(prompt, output, end - n, end)
            if tuple(gram[:-1]) == context:
                banned.add(gram[-1])
        return sorted(banned)


def _window(prompt: Sequence[int], output: Sequence[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without joining the two lists."""
    num_prompt = len(prompt)
    return [*prompt[start:min(end, num_prompt)],
            *output[max(start - num_prompt, 0):max(end - num_prompt, 0)]]

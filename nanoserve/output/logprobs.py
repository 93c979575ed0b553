"""Logprobs as users see them: token id -> Logprob(logprob, rank, decoded text)."""

from __future__ import annotations

from typing import Any

from nanoserve.outputs import Logprob, PositionLogprobs
from nanoserve.protocol import TokenLogprobs


class LogprobsFormatter:
    """Turns the engine's TokenLogprobs into per-position dicts, decoding each token once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = text
        return text

    def position(self, entry: TokenLogprobs) -> PositionLogprobs:
        """The chosen token first, then the top-N (ranks 1..N)."""
        out = {entry.token_id: Logprob(entry.logprob, entry.rank,
                                       self.token_text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(
                zip(entry.top_ids, entry.top_logprobs, strict=True), start=1):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, self.token_text(token_id))
        return out

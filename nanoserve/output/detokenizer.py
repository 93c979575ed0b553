"""Incremental detokenization: text deltas from a growing list of token ids.

Byte-level BPE can split one character over several tokens, so decoding the newest token alone
may give "\ufffd". We decode a short window (a few tokens before the unread ones) and emit only
the text past the window's already-read part, holding back while it ends in an incomplete
character. Each token costs a decode of a handful of tokens, not of the whole output.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_WINDOW = 5  # tokens of already-emitted context decoded with the new ones


class IncrementalDetokenizer:
    """Turns each step's new token ids into the text they complete."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly settled text (possibly empty)."""
        delta = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            delta += self._step()
        self.output_text += delta
        return delta

    def _step(self) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=skip)
        text = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""  # an incomplete character (or nothing visible) so far: wait
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        # keep the window short: only the tokens from prefix_offset on are ever decoded again
        if self.prefix_offset > 4 * _WINDOW:
            del self.token_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return text[len(prefix) :]

"""Incremental detokenization: the text that each new token completes, O(1) work per token.

Byte-level BPE splits characters across tokens, so decoding the newest token alone can give
"\ufffd"; both detokenizers here hold such bytes back until the character is whole.

* Fast path: the tokenizers library's `DecodeStream`, primed with the prompt's last tokens so
  the first output token decodes in context (a leading space stays a space).
* Fallback (tokenizers without a Rust backend, and prompts that end in the middle of a
  character): the prefix/read-offset method, which decodes a short window of tokens and emits
  the text past the window's already-read part. It attributes a character begun in the prompt
  to the prompt, so no prompt text leaks into the output (vLLM #48853).

The text is what `tokenizer.decode(output_ids, skip_special_tokens=...)` gives. With
`skip_special_tokens=False` and `spaces_between_special_tokens=True` (the default, as in
transformers' slow tokenizers) special tokens are also set apart by a space from their
neighbours; `decode_text` is the non-incremental definition of that text.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens decoded before the first output token


class IncrementalDetokenizer:
    """Turns each step's new token ids into the text they complete."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaced_specials = not skip_special_tokens and spaces_between_special_tokens
        self.special_ids = frozenset(tokenizer.all_special_ids) if self.spaced_specials \
            else frozenset()
        self.output_text = ""
        context = list(prompt_token_ids[-PROMPT_CONTEXT:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        ends_mid_character = tokenizer.decode(
            context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT)
        self._stream: _Stream = (
            _DecodeStream(backend, context, skip_special_tokens)
            if backend is not None and not ends_mid_character
            else _OffsetStream(tokenizer, context, skip_special_tokens))
        self._after_special = False  # the last emitted piece was a spaced special token
        self._settled: list[int] = context[-PROMPT_CONTEXT:]  # last tokens whose text is out
        self._pending: list[int] = []  # tokens whose bytes have not made a character yet

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly settled text (possibly empty)."""
        delta = ""
        for token_id in new_token_ids:
            self._pending.append(token_id)
            if token_id in self.special_ids:
                # a special token shown as its own piece, spaced from its neighbours; bytes
                # still waiting for a character end their run first, as "\ufffd"
                self._pending.pop()
                delta += self._flush_pending()
                self._pending.append(token_id)
                text = self.tokenizer.convert_ids_to_tokens(token_id)
                piece = (" " if self.output_text or delta else "") + text
                self._stream = self._stream.fresh()
                self._after_special = True
            else:
                piece = self._stream.step(token_id)
                if piece and self._after_special:
                    piece = " " + piece
                    self._after_special = False
            if piece:
                self._settled = (self._settled + self._pending)[-PROMPT_CONTEXT:]
                self._pending = []
            delta += piece
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end: the text of tokens still waiting to complete a character (as "\ufffd",
        just as a plain decode shows them)."""
        piece = self._flush_pending()
        self.output_text += piece
        return piece

    def _flush_pending(self) -> str:
        if not self._pending:
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self._settled, skip_special_tokens=skip)
        text = decode(self._settled + self._pending, skip_special_tokens=skip)
        self._pending = []
        piece = text[len(before) :] if text.startswith(before) else ""
        if piece and self._after_special:
            piece = " " + piece
            self._after_special = False
        return piece


class _Stream:
    def step(self, token_id: int) -> str:
        raise NotImplementedError

    def fresh(self) -> _Stream:
        """A stream with no context (text after a special token decodes on its own)."""
        raise NotImplementedError


class _DecodeStream(_Stream):
    def __init__(self, backend: Any, context: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.skip = skip_special_tokens
        self.stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""

    def fresh(self) -> _Stream:
        return _DecodeStream(self.backend, [], self.skip)


class _OffsetStream(_Stream):
    """The prefix/read-offset method over a sliding window of token ids."""

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.token_ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip)
        text = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""  # nothing visible yet, or an incomplete character: wait
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if self.prefix_offset > 4 * PROMPT_CONTEXT:  # keep the window short
            del self.token_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return text[len(prefix) :]

    def fresh(self) -> _Stream:
        return _OffsetStream(self.tokenizer, [], self.skip)


def decode_text(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True) -> str:
    """The whole text of `token_ids` at once: what the incremental detokenizer adds up to."""
    if skip_special_tokens or not spaces_between_special_tokens:
        return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))
    special = set(tokenizer.all_special_ids)
    pieces: list[str] = []
    run: list[int] = []
    for token_id in [*token_ids, None]:
        if token_id is not None and token_id not in special:
            run.append(token_id)
            continue
        if run:
            text = tokenizer.decode(run, skip_special_tokens=False)
            if text:
                pieces.append(text)
            run = []
        if token_id is not None:
            pieces.append(tokenizer.convert_ids_to_tokens(token_id))
    return " ".join(pieces)

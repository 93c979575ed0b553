"""Splitting a model's `<think>…</think>` reasoning from its answer, on streamed text.

`ChatStreamParser` (`chat_stream.py`) feeds one generated sample's text deltas to a
`ReasoningParser` as they arrive and passes on the reasoning and content it returns as neutral
events; `finish()` flushes what was held back when the stream ends. `parse()` splits a whole
text at once, and always equals what feeding that text in any chunks and then finishing adds up
to ("" ↔ None).

Semantics (vLLM's `--reasoning-parser` names `qwen3` and `deepseek_r1`):

- A sample has at most one reasoning section, at the start. It opens at the start of the
  output (or before it, in the prompt) and closes at the first `</think>`; everything after
  that is content, later tags included, verbatim.
- The opening `<think>` and the closing `</think>` never appear in either field. All other
  text is kept verbatim: the "\\n" Qwen3 writes after `<think>` and around `</think>` stays in
  the fields (as vLLM keeps it). Only whitespace *before* an opening `<think>` at the start of
  the output is dropped with the tag (vLLM drops everything before `<think>`).
- Starting states. `qwen3` with `prompt_ends_in_reasoning=False` starts "before": a `<think>`
  at the very start (after optional whitespace) opens reasoning; any other output is a direct
  answer, all content (a later `<think>` is then content text). `qwen3` with
  `prompt_ends_in_reasoning=True` (the chat template already wrote `<think>`) and
  `deepseek_r1` (whatever the prompt; R1 models often omit `<think>`) start inside reasoning;
  a `<think>` at the very start (after optional whitespace) is still dropped, while one
  further in is reasoning text.
- An output that ends inside reasoning (no `</think>`: the model ran out of tokens while
  thinking) is all reasoning, for both parsers. This is vLLM's DeepSeek-R1 behaviour; vLLM's
  non-streamed Qwen3 parser instead returns such an output as content.
- Held back while streaming: in the starting phase, leading whitespace plus anything that may
  still become `<think>`; inside reasoning, a tail that may still become `</think>`. Content is
  never held. A partial tag still held at `finish()` is ordinary text of the field it was in.
"""

from __future__ import annotations

from nanoserve.reasoning_section import END_TAG, START_TAG

REASONING_PARSERS = ("qwen3", "deepseek_r1")

_OPENING = "opening"  # at the start of the output: whitespace and a `<think>` may come
_REASONING = "reasoning"
_CONTENT = "content"


class ReasoningParser:
    """Splits one sample's streamed text into reasoning and content deltas (see the module)."""

    start = START_TAG
    end = END_TAG

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _OPENING
        self._held = ""  # text not yet sent, still ambiguous

    def feed(self, delta: str) -> tuple[str, str]:
        """Returns `(reasoning_delta, content_delta)` for this piece of the output."""
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        while text:
            if self._state == _OPENING:
                body = text.lstrip()
                if body.startswith(self.start):
                    self._state, text = _REASONING, body[len(self.start):]
                elif self.start.startswith(body):  # whitespace, then maybe a partial `<think>`
                    self._held = text
                    break
                else:  # no opening tag: the same text, read from the state after the start
                    self._state = _REASONING if self.starts_in_reasoning else _CONTENT
            elif self._state == _REASONING:
                at = text.find(self.end)
                if at != -1:
                    reasoning += text[:at]
                    self._state, text = _CONTENT, text[at + len(self.end):]
                    continue
                keep = len(text) - _partial_tag_length(text, self.end)
                reasoning, self._held = reasoning + text[:keep], text[keep:]
                break
            else:
                content += text
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flushes what is held back at the end of the stream, into the field it was in."""
        held, self._held = self._held, ""
        if self._state == _REASONING or (self._state == _OPENING and self.starts_in_reasoning):
            return held, ""
        return "", held

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """The non-streamed split of a whole output: `(reasoning, content)`, None where empty.

        Independent of any streaming in progress on this parser."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, _, content = body.partition(self.end)
        return reasoning or None, content or None


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def make_reasoning_parser(name: str, prompt_ends_in_reasoning: bool) -> ReasoningParser:
    """A fresh parser for one sample; `prompt_ends_in_reasoning` matters to `qwen3` only."""
    if name == "qwen3":
        return ReasoningParser(starts_in_reasoning=prompt_ends_in_reasoning)
    if name == "deepseek_r1":
        return ReasoningParser(starts_in_reasoning=True)
    raise ValueError(f"unknown reasoning parser {name!r}; expected one of {REASONING_PARSERS}")


def prompt_ends_in_reasoning(prompt_text: str) -> bool:
    """True when the prompt's last `<think>` is not followed by a `</think>`: the chat template
    opened the reasoning section (Qwen3 with enable_thinking ends the prompt in "<think>\\n";
    with enable_thinking=False it writes "<think>\\n\\n</think>\\n\\n", which is not inside)."""
    at = prompt_text.rfind(ReasoningParser.start)
    return at != -1 and ReasoningParser.end not in prompt_text[at:]

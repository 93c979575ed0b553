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

`gemma4` (Gemma 4; llama.cpp's and vLLM's `gemma4` parsers) reads another syntax, whose tags are
special tokens that ordinary text never holds, so it reads them anywhere:

- A section is `<|channel>` … `<channel|>`; its `thought` label and the one "\\n" after it are
  not reasoning (vLLM strips "thought\\n"; llama.cpp strips the label and any whitespace). With
  thinking off the chat template ends the prompt in an empty section,
  `<|channel>thought\\n<channel|>`, and the output is all content.
- Every section in the output is reasoning, in order, not only one at the start: Gemma 4 writes
  an extra empty `<|channel>thought\\n<channel|>` after its answer at times (llama.cpp PR
  #21760). Empty extra `<|channel>` tokens at a section's start and a stray `<channel|>` in the
  content are dropped; a `<|turn>model\\n` at the very start of the output (the model opening
  the turn a template left closed) is dropped too, as llama.cpp does.
- Content around the sections is kept verbatim; an output that ends inside a section is
  reasoning up to there.
- Held back while streaming: at the very start, a partial `<|turn>model\\n`; in the content, a
  partial tag (so here content is held, for at most nine characters); at a section's start, a
  partial `thought\\n` or `<|channel>`; inside, a partial `<channel|>`. At `finish()` a held
  label alone is dropped and any other held text is text of the field it was in.

`openai_gptoss` (gpt-oss's harmony channels; vLLM's name) is `harmony.py`'s parser with calls
swallowed; with tools, `HarmonyParser` itself reads reasoning and calls in one pass.
"""

from __future__ import annotations

from nanoserve.parsers.events import ReasoningDelta
from nanoserve.parsers.harmony import (
    CHANNEL,
    END,
    MESSAGE,
    HarmonyEvent,
    HarmonyParser,
)
from nanoserve.reasoning_section import END_TAG, START_TAG

REASONING_PARSERS = ("qwen3", "deepseek_r1", "gemma4", "openai_gptoss")

_OPENING = "opening"  # at the start of the output: whitespace and a `<think>` may come
_REASONING = "reasoning"
_CONTENT = "content"
_TURN = "turn"  # gemma4: at the very start of the output, where `<|turn>model\n` may come
_LABEL = "label"  # gemma4: after `<|channel>`, where its `thought` label may come


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


class Gemma4ReasoningParser(ReasoningParser):
    """Gemma 4's `<|channel>thought\\n…<channel|>` sections, anywhere in the output (see the
    module); `starts_in_reasoning`: the prompt ended inside a section."""

    start = "<|channel>"
    end = "<channel|>"
    label = "thought"
    model_turn = "<|turn>model\n"

    def __init__(self, starts_in_reasoning: bool) -> None:
        super().__init__(starts_in_reasoning)
        self._state = _REASONING if starts_in_reasoning else _TURN

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == _TURN:
                text = self._turn(text)
            elif self._state == _CONTENT:
                text = self._content(text, content)
            elif self._state == _LABEL:
                text = self._label(text)
            else:
                text = self._reasoning(text, reasoning)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state in (_TURN, _CONTENT):
            return "", held
        if self._state == _LABEL and held == self.label:  # the label alone: not reasoning
            return "", ""
        return held, ""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        parser = Gemma4ReasoningParser(self.starts_in_reasoning)
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.finish()
        return reasoning + more_reasoning or None, content + more_content or None

    def _turn(self, text: str) -> str:
        """The very start of the output, where the model may open its own turn."""
        if text.startswith(self.model_turn):
            self._state = _CONTENT
            return text[len(self.model_turn):]
        if self.model_turn.startswith(text):
            self._held = text
            return ""
        self._state = _CONTENT
        return text

    def _content(self, text: str, content: list[str]) -> str:
        found = [(at, tag) for tag in (self.start, self.end) if (at := text.find(tag)) != -1]
        if not found:
            keep = len(text) - max(_partial_tag_length(text, self.start),
                                   _partial_tag_length(text, self.end))
            content.append(text[:keep])
            self._held = text[keep:]
            return ""
        at, tag = min(found)
        content.append(text[:at])
        if tag == self.start:
            self._state = _LABEL
        return text[at + len(tag):]  # (a stray `<channel|>` is dropped)

    def _label(self, text: str) -> str:
        """A section's start: empty extra `<|channel>` tokens, then its label."""
        if text.startswith(self.start):
            return text[len(self.start):]
        if text.startswith(self.label):
            rest = text[len(self.label):]
            if not rest:  # the label's newline may follow
                self._held = text
                return ""
            self._state = _REASONING
            return rest.removeprefix("\n")
        if (self.label + "\n").startswith(text) or self.start.startswith(text):
            self._held = text
            return ""
        self._state = _REASONING
        return text

    def _reasoning(self, text: str, reasoning: list[str]) -> str:
        at = text.find(self.end)
        if at != -1:
            reasoning.append(text[:at])
            self._state = _CONTENT
            return text[at + len(self.end):]
        keep = len(text) - _partial_tag_length(text, self.end)
        reasoning.append(text[:keep])
        self._held = text[keep:]
        return ""


class HarmonyReasoningParser(ReasoningParser):
    """`openai_gptoss` without a tool-call parser: analysis as reasoning, the final and
    commentary text as content, calls swallowed (a `HarmonyParser` underneath)."""

    start = CHANNEL + "analysis" + MESSAGE  # what `prompt_ends_in_reasoning` looks for
    end = END

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self._messages = HarmonyParser(parses_calls=False)

    def feed(self, delta: str) -> tuple[str, str]:
        return _harmony_split(self._messages.feed(delta))

    def finish(self) -> tuple[str, str]:
        return _harmony_split(self._messages.finish())

    def parse(self, text: str) -> tuple[str | None, str | None]:
        content, reasoning, _ = self._messages.parse_message(text)
        return reasoning, content


def _harmony_split(events: list[HarmonyEvent]) -> tuple[str, str]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    return reasoning, "".join(e for e in events if isinstance(e, str))


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser, "deepseek_r1": ReasoningParser, "gemma4": Gemma4ReasoningParser,
    "openai_gptoss": HarmonyReasoningParser}


def make_reasoning_parser(name: str, prompt_ends_in_reasoning: bool) -> ReasoningParser:
    """A fresh parser for one sample; `prompt_ends_in_reasoning` matters to `qwen3` and
    `gemma4` (`deepseek_r1` always starts inside)."""
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of "
                         f"{REASONING_PARSERS}")
    return _PARSERS[name](starts_in_reasoning=prompt_ends_in_reasoning or name == "deepseek_r1")


def prompt_ends_in_reasoning(prompt_text: str, parser: str = "qwen3") -> bool:
    """True when the prompt's last opening tag (`parser`'s) is not followed by a closing one: the
    chat template opened the reasoning section. Qwen3 with enable_thinking ends the prompt in
    "<think>\\n"; with enable_thinking=False it writes "<think>\\n\\n</think>\\n\\n", which is
    not inside. Gemma 4 with thinking on ends it in "<|turn>model\\n", with thinking off in
    "<|channel>thought\\n<channel|>": neither is inside."""
    tags = _PARSERS.get(parser, ReasoningParser)
    at = prompt_text.rfind(tags.start)
    return at != -1 and tags.end not in prompt_text[at:]

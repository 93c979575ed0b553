"""An exact repeat in a grammar-forced call list, found as the text grows.

`tool_choice="required"` (Anthropic's `any`) forces a JSON array of calls
`[{"name": ..., "parameters": {...}}, ...]`, and its grammar lets the list end after every
complete call. A weak model still writes `,` and the same call again: the default model at
temperature 0 wrote one `search` call three times, identically, until its budget ran out. A
second identical call in one answer is never what a client wants, so the sample ends at the
repeat: its text is cut after the last call that was new, and the caller aborts the engine
request at once, so no more of the budget goes to it.

"Identical" is the item's JSON text with the whitespace between tokens dropped (whitespace
inside strings counts). While the item being written could still become such a repeat, the
text from the end of the last new call is held back, so a stream never shows a call that is
then taken away. A grammar cannot forbid the repeat itself: which items came before is context
a JSON schema (and llguidance's `uniqueItems`-free subset of it) cannot carry, and forbidding a
tool's second call outright would also forbid two calls of one tool with different arguments.

Where the grammar starts after the reasoning (`after_reasoning`), the array is the answer after
the sample's reasoning section, found by `reasoning_section.answer_start`.
"""

from __future__ import annotations

from nanoserve.reasoning_section import answer_start

_WHITESPACE = " \t\r\n"


class RepeatedItemChecker:
    """Scans a growing JSON array (the top level of a sample's text) item by item."""

    def __init__(self, after_reasoning: str | None = None) -> None:
        """`after_reasoning`: how the output begins when the array follows a reasoning
        section (`StructuredOutputsParams.after_reasoning`); None: the text is the array."""
        self._after_reasoning = after_reasoning
        self._start: int | None = 0 if after_reasoning is None else None  # the array's
        self._num_scanned = 0
        self._depth = 0
        self._is_in_string = self._is_escaped = False
        self._item: list[str] = []  # the current top-level item, whitespace outside strings off
        self._items: set[str] = set()  # the complete items so far, in that form
        self._last_item_end = 0  # where the text after the last new item begins
        self.repeat_at: int | None = None  # the text's end once cut, when a repeat completed

    def scan(self, text: str) -> int | None:
        """Read what `text` adds to the text scanned before; the length to cut it to if an item
        that completes in it repeats an earlier one (then scanning stops)."""
        if self.repeat_at is not None:
            return self.repeat_at
        if self._start is None:
            assert self._after_reasoning is not None
            self._start = answer_start(text, self._after_reasoning)
            if self._start is None:
                return None
            self._num_scanned = self._last_item_end = self._start
        for i in range(self._num_scanned, len(text)):
            if self._read(text[i], i):
                self.repeat_at = self._last_item_end
                break
        self._num_scanned = len(text)
        return self.repeat_at

    def held_back(self, text: str) -> int:
        """How many trailing characters to hold back: those after the last new item, while the
        item begun there could still repeat an earlier one."""
        if self._depth < 1 or not self._items:
            return 0
        so_far = "".join(self._item)
        if self._depth == 1 or any(item.startswith(so_far) for item in self._items):
            return len(text) - self._last_item_end
        return 0

    def _read(self, char: str, index: int) -> bool:
        """One character; True when it completes an item that repeats an earlier one."""
        if self._is_in_string:
            self._item.append(char)
            if self._is_escaped:
                self._is_escaped = False
            elif char == "\\":
                self._is_escaped = True
            elif char == '"':
                self._is_in_string = False
            return False
        if char in _WHITESPACE:
            return False
        if self._depth >= 2 or char not in "[]{},":
            self._item.append(char)
        if char == '"':
            self._is_in_string = True
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:
                self._item = [char]
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1:
                return self._complete(index)
        return False

    def _complete(self, index: int) -> bool:
        item = "".join(self._item)
        self._item = []
        if item in self._items:
            return True
        self._items.add(item)
        self._last_item_end = index + 1
        return False

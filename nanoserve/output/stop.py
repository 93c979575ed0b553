"""Stop strings on streamed text, with hold-back.

Text already sent cannot be taken back, and a stop string can arrive over several tokens. So
the tail of the text that could still be the beginning of a stop string is held back until
the next tokens settle it: for stop "\\n解释" and text "...42。\\n", the "\\n" waits. When a
stop string completes, the text is cut before it (or after it, with
`include_stop_str_in_output`) and the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    stop: str
    text_end: int  # where the output text ends once cut


class StopStringChecker:
    """Finds stop strings in a growing text and says how much of it is safe to send."""

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The first stop string to complete (earliest end, then earliest start) among those
        that end within the last `num_new_chars` characters."""
        if not self.stops or num_new_chars <= 0:
            return None
        old_end = len(text) - num_new_chars
        start = max(0, old_end - self.longest + 1)
        best: StopMatch | None = None
        best_key = (len(text) + 1, 0)
        for stop in self.stops:
            at = text.find(stop, max(start, old_end - len(stop) + 1))  # must end in new text
            if at != -1 and (at + len(stop), at) < best_key:
                best_key = (at + len(stop), at)
                best = StopMatch(stop, at + len(stop) if self.include else at)
        return best

    def held_back(self, text: str) -> int:
        """How many trailing characters might begin a stop string (so must not be sent)."""
        if self.include or not self.stops:
            return 0  # a stop string would be sent anyway, so its beginning can go now
        hold = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:length]):
                    hold = length
                    break
        return hold

"""A download's progress as Ollama's `/api/pull` reports it, and a sink that draws it as one
bar per file on the terminal.

Every source (hub, registry) reports through a `ProgressSink`: the CLI draws bars, `/api/pull`
writes each event as an NDJSON line, the router logs it and shows it in `/v1/models`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """One step of a pull, in Ollama's words: `status` alone ("pulling manifest",
    "verifying sha256 digest", "writing manifest", "success"), or a file's transfer
    (`digest`: "sha256:<hex>", `total` and `completed` in bytes)."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The NDJSON line's object, without the fields that are unset (as Ollama writes it)."""
        return {k: v for k, v in (("status", self.status), ("digest", self.digest),
                                  ("total", self.total), ("completed", self.completed))
                if v is not None}


ProgressSink = Callable[[Progress], None]


def no_progress(_event: Progress) -> None:
    """A sink that drops every event."""


class TerminalProgress:
    """One tqdm bar per file on stderr (a file is a `digest`), its status lines printed as
    they come. Bars are closed when their file completes."""

    def __init__(self, file: Any = None) -> None:
        self.file = file or sys.stderr
        self.bars: dict[str, Any] = {}

    def __call__(self, event: Progress) -> None:
        from tqdm import tqdm

        if event.digest is None or event.total is None:
            for bar in self.bars.values():
                bar.close()
            self.bars.clear()
            print(event.status, file=self.file, flush=True)
            return
        bar = self.bars.get(event.digest)
        if bar is None:
            bar = self.bars[event.digest] = tqdm(
                total=event.total, unit="B", unit_scale=True, unit_divisor=1024,
                desc=event.status, file=self.file, leave=True, dynamic_ncols=True)
        bar.update((event.completed or 0) - bar.n)
        if event.completed is not None and event.completed >= event.total:
            bar.close()
            del self.bars[event.digest]

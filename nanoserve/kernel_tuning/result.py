"""What a tuning run did (tuner.py), as `nanoserve tune` prints it (report.py) and the start-up
log describes it: the schedule set, each class's timed candidates, the step check's verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

import nanoserve.native as native
from nanoserve.kernel_tuning.schedule import Schedule
from nanoserve.kernel_tuning.step_check import StepCheck


@dataclass(frozen=True)
class Row:
    """One candidate's line in `nanoserve tune`'s table."""

    shape: str
    candidate: str
    seconds: float
    rate: str  # "21.4 GB/s" or "310 GMAC/s"
    is_chosen: bool


@dataclass
class TuneResult:
    """What the tuner did: the schedule it set, and how it got each class."""

    schedule: Schedule
    layouts: list[str]
    rows: list[Row] = field(default_factory=list)  # the classes timed in this run
    reused: list[str] = field(default_factory=list)  # the classes read from the cache
    skipped: list[str] = field(default_factory=list)  # past the budget: defaults, not cached
    tier: str | None = None  # the tier measured fastest (where it differs: from the next start)
    tier_running: str | None = None
    step_check: StepCheck | None = None  # the step A/B behind the schedule (None: none ran)
    seconds: float = 0.0

    def describe(self) -> str:
        """The schedule in one line, as the start-up log and /get_server_info show it."""
        return self.schedule.describe(self.layouts, native.loaded_tier())

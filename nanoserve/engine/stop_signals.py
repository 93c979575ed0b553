"""Who stops a server's processes: its main process, always.

A server is a tree of processes: the launcher, its engine cores and their tensor-parallel
workers, extra API processes, and under a `--models-dir` router one such tree per model. A
signal sent to the whole tree (systemd's default `KillMode=control-group`, supervisord's
`stopasgroup`, `kill -- -PGID`, a terminal's hang-up) reaches every process at once; if each
acted on it, the engine core would be gone before the API had drained its requests or the disk
tier been written. So only the main process acts on SIGTERM, SIGINT and SIGHUP (the first
drains, a second stops at once), and every child

- starts with them blocked (held across its spawn: one that arrives before the child's first
  line of Python is neither lost to the parent nor acted on by default in the child), then
  ignores them for good (`ignore_stop_signals`);
- is told to stop by its parent, in order: an engine core by a `Shutdown` message, an API
  process or a router's model server by `PARENT_STOP_SIGNAL` (drain, then stop; a second
  one: stop now), a tensor-parallel worker by its rank 0;
- exits by itself once its parent is gone.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PARENT_STOP_SIGNAL = signal.SIGUSR1  # never sent by a service manager or a terminal


@contextlib.contextmanager
def held_for_children() -> Iterator[None]:
    """Spawn children inside this: they start with the stop signals and PARENT_STOP_SIGNAL
    blocked (a signal mask survives fork and exec) until they have set what each means to
    them, and one that reaches this process meanwhile waits, not lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, (*STOP_SIGNALS, PARENT_STOP_SIGNAL))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """A child's first act: the stop signals ignored from now on (one pending since its spawn
    is dropped), and unblocked, so that the children it starts inherit `ignored`."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class StopRequests:
    """The stop signals a main process acts on, counted from its first line to its exit: the
    first asks for a drain, any later one to stop at once. The part of the process that is
    running at the time subscribes (`on_stop`): the API server while it serves, the launcher
    while it stops its children; a signal that came before anyone subscribed is `requested`.

    Signals within SAME_STOP_S of the last one counted are the same stop: a wrapper in the
    group (make, a shell script, `uv run`) forwards the signal it got to its child, which so
    gets the group's signal twice in the same millisecond, and that is not a second stop."""

    SAME_STOP_S = 1.0

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = signals
        self.count = 0
        self._last_at = -math.inf
        self._callback: Callable[[int], None] | None = None
        for signum in signals:
            signal.signal(signum, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # held since the spawn, maybe

    @property
    def requested(self) -> bool:
        return self.count > 0

    def on_stop(self, callback: Callable[[int], None] | None) -> None:
        """`callback(count)` on each signal from now on (the count so far, this one included);
        one that came before is the subscriber's to look at (`requested`)."""
        self._callback = callback

    def _on_signal(self, signum: int, _frame: object) -> None:
        now = time.monotonic()
        if now - self._last_at < self.SAME_STOP_S:
            return
        self._last_at = now
        self.count += 1
        if self._callback is not None:
            self._callback(self.count)

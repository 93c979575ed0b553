"""The processes of a server under test, found through /proc whatever their group or session
(a router's model servers run in sessions of their own), and signals sent as the tools users
stop servers with send them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) of every live process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            continue
        if state not in ("Z", "X"):
            found[int(stat.parent.name)] = (int(ppid), int(pgrp),
                                            cmdline.decode(errors="replace"))
    return found


def group_members(pgid: int) -> list[str]:
    """`pid cmdline` of each live process of process group `pgid`."""
    return [f"{pid} {cmd}" for pid, (_, pgrp, cmd) in _processes().items() if pgrp == pgid]


def tree(root: int) -> set[int]:
    """`root` and its live descendants, in whatever group or session (a router's model
    servers run in sessions of their own)."""
    parents = {pid: ppid for pid, (ppid, _, _) in _processes().items()}
    found = {root} if root in parents else set()
    while True:
        more = {pid for pid, ppid in parents.items() if ppid in found} - found
        if not more:
            return found
        found |= more


def still_running(pids: set[int]) -> list[str]:
    live = _processes()
    return [f"{pid} {live[pid][2]}" for pid in sorted(pids) if pid in live]


def signal_tree(root: int, signum: int) -> set[int]:
    """`signum` to `root` and every live descendant at once, as systemd's default
    `KillMode=control-group` sends its stop signal to every process of the unit; returns
    the pids signalled."""
    pids = tree(root)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return pids

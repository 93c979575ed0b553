"""`nanoserve tune`'s table: every candidate of every shape class timed, and the choice."""

from __future__ import annotations

from nanoserve.kernel_tuning.tuner import TuneResult


def format_result(result: TuneResult) -> str:
    """Candidate x shape class: its median time, its rate (GB/s streamed, or GMAC/s), and the
    choice marked; then the schedule this machine runs from now on."""
    lines = ["| shape class | candidate | time | rate | |", "|---|---|---:|---:|---|"]
    for row in result.rows:
        time = f"{row.seconds * 1e3:.2f} ms" if row.seconds else ""
        lines.append(f"| {row.shape} | {row.candidate} | {time} | {row.rate} | "
                     f"{'chosen' if row.is_chosen else ''} |")
    lines.append("")
    if result.reused:
        lines.append(f"read from the cache: {', '.join(result.reused)}")
    if result.skipped:
        lines.append(f"past the time budget, left at the defaults: {', '.join(result.skipped)}")
    if result.tier is not None:
        lines.append(f"tier: {result.tier}" + (" (from the next start)"
                                               if result.tier != result.tier_running else ""))
    lines.append(f"schedule: {result.describe()}")
    lines.append(f"tuned in {result.seconds:.1f} s")
    return "\n".join(lines)

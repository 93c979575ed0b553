"""`nanoserve tune`'s table: every candidate of every shape class timed, and the choice."""

from __future__ import annotations

from nanoserve.kernel_tuning.result import TuneResult
from nanoserve.kernel_tuning.schedule import DEFAULT
from nanoserve.kernel_tuning.step_check import StepCheck, Timing, group_value


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
    if result.step_check is not None:
        lines += ["", *format_step_check(result.step_check, result.layouts), ""]
    lines.append(f"schedule: {result.describe()}")
    lines.append(f"tuned in {result.seconds:.1f} s")
    return "\n".join(lines)


def format_step_check(check: StepCheck, layouts: list[str]) -> list[str]:
    """The step A/B: per batch size the step with the built-in schedule and with the tuned
    one, and the tuned one's speed against the built-in (the median of the rounds' ratios);
    where only some groups were kept, the same for the schedule kept; then each group of
    knobs the tuned schedule changed, kept or reverted, and what runs."""
    source = "read from the cache" if check.is_cached else "timed now"
    lines = [f"whole decode steps ({source}), the built-in schedule (--kernel-tuning off) "
             "against the tuned one:", "", *_ab_table(check, check.tuned, "tuned")]
    kept = check.schedule
    if kept not in (DEFAULT, check.tuned_schedule):
        lines += ["", "and against the schedule kept, timed together:", "",
                  *_ab_table(check, check.kept, "kept", check.kept_builtin)]
    lines += ["", "(a step: each schedule's median step; speed: the median over the rounds of "
              "the built-in step over this one in the same round, so a machine drifting "
              "between rounds cancels out)", ""]
    for verdict, groups in (("kept", check.kept_groups),
                            ("reverted to the built-in", check.reverted_groups)):
        lines += [f"{verdict}: {name} {group_value(name, check.tuned_schedule, layouts)} "
                  f"(built-in {group_value(name, DEFAULT, layouts)})" for name in groups]
    lines.append("runs: " + ("the built-in schedule" if kept == DEFAULT else
                             "the tuned schedule" if kept == check.tuned_schedule else
                             "the built-in one with the groups kept"))
    return lines


def _ab_table(check: StepCheck, other: Timing, name: str,
              builtin: Timing | None = None) -> list[str]:
    builtin = builtin or check.builtin
    lines = [f"| batch | built-in | {name} | {name} speed |", "|---:|---:|---:|---:|"]
    for i, batch in enumerate(check.batches):
        lines.append(f"| {batch} | {builtin.seconds[i] * 1e3:.2f} ms | "
                     f"{other.seconds[i] * 1e3:.2f} ms | {1 / other.ratios[i]:.2f}x |")
    return lines

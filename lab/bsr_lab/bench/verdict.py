"""Whether a measured ratio meets its goal, read from its 95% interval, not its point.

A ratio whose point estimate sits inside the goal while its interval reaches out of it
has not shown that it meets the goal: the run's noise could put it either side. So a
comparison is "met" only when its whole interval lies inside the goal, "not met" only
when the whole interval lies outside, and "not resolved" otherwise (the run's noise
floor is wider than what it tries to tell apart).

`SERVE_GOALS` is the serving miss penalty's goal (bench serve): at saturation, steady
throughput at least 0.97x the reference's and TTFT p50 at most 1.05x. `judge` applies
them to bench serve's `saturated_95` intervals, with the control's own interval (the
reference against itself) beside each verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

Verdict = Literal["met", "not met", "not resolved"]
MET: Verdict = "met"
NOT_MET: Verdict = "not met"
NOT_RESOLVED: Verdict = "not resolved"

# quantity (a key of a serve-pool comparison) -> (lowest, highest) allowed; None: open.
SERVE_GOALS: dict[str, tuple[float | None, float | None]] = {
    "steady_throughput_ratio": (0.97, None),
    "ttft_p50_ratio": (None, 1.05),
}
# The comparisons of bsr-io that get a verdict, and the A/A one that is their noise floor.
JUDGED = ("bsr_io_vs_references", "bsr_io_vs_control", "bsr_io_vs_baseline")
NOISE = "control_vs_baseline"


def verdict(lo: float, hi: float, goal_lo: float | None, goal_hi: float | None) -> Verdict:
    """ "met" when [lo, hi] lies inside [goal_lo, goal_hi] (bounds included), "not met"
    when it lies wholly outside, "not resolved" when it straddles a bound. A goal bound
    of None is open on that side. ValueError for an interval or goal that is not one."""
    for name, v in (("lo", lo), ("hi", hi), ("goal_lo", goal_lo), ("goal_hi", goal_hi)):
        if v is not None and math.isnan(v):
            raise ValueError(f"verdict: {name} must be a number, got {v!r}")
    if lo > hi:
        raise ValueError(f"verdict: the interval's low end {lo} is above its high end {hi}")
    floor = -math.inf if goal_lo is None else goal_lo
    ceiling = math.inf if goal_hi is None else goal_hi
    if floor > ceiling:
        raise ValueError(f"verdict: the goal's low end {goal_lo} is above its high end {goal_hi}")
    if floor <= lo and hi <= ceiling:
        return MET
    if hi < floor or lo > ceiling:
        return NOT_MET
    return NOT_RESOLVED


def judge(
    intervals: Mapping[str, Mapping[str, Any]],
    goals: Mapping[str, tuple[float | None, float | None]] = SERVE_GOALS,
) -> dict[str, Any]:
    """Per comparison of `JUDGED` found in `intervals` (serve-pool's `intervals` output)
    and per quantity of `goals`: the ratio, its 95% interval, the verdict, and the
    control's ratio and interval against the reference (`NOISE`) when the run has one."""
    out: dict[str, Any] = {"goal": {q: list(g) for q, g in goals.items()}}
    noise = intervals.get(NOISE)
    for name in JUDGED:
        pair = intervals.get(name)
        if pair is None:
            continue
        out[name] = {}
        for q, (glo, ghi) in goals.items():
            lo, hi = pair[f"{q}_95"]
            row: dict[str, Any] = {
                "ratio": pair[q],
                "interval_95": [lo, hi],
                "verdict": verdict(lo, hi, glo, ghi),
            }
            if noise is not None:
                row["control_ratio"] = noise[q]
                row["control_interval_95"] = list(noise[f"{q}_95"])
            out[name][q] = row
    return out


def goal_text(goal: tuple[float | None, float | None] | list[float | None]) -> str:
    lo, hi = goal
    if lo is not None and hi is not None:
        return f"{lo}x to {hi}x"
    return f">= {lo}x" if lo is not None else f"<= {hi}x"


def lines(judged: Mapping[str, Any]) -> list[str]:
    """`judge`'s result as one printed line per comparison and quantity."""
    out = []
    for name in JUDGED:
        for q, row in judged.get(name, {}).items():
            lo, hi = row["interval_95"]
            said = row["verdict"]
            if said == NOT_RESOLVED:
                said = "not resolved at this noise floor"
            text = (
                f"{q} {name.removeprefix('bsr_io_vs_')}: {row['ratio']:.3f}x "
                f"(95% {lo:.3f}x to {hi:.3f}x), goal {goal_text(judged['goal'][q])}: {said}"
            )
            if "control_interval_95" in row:
                clo, chi = row["control_interval_95"]
                text += (
                    f"; control vs reference {row['control_ratio']:.3f}x ({clo:.3f}x to {chi:.3f}x)"
                )
            out.append(text)
    return out

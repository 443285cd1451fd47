"""The fixed cost of a restore: a line through time against bytes, and where a restore's
time went (its phases), for `bench ttft --sweep`."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line weighted by 1/x^2: a restore's noise
    grows with its size, so unweighted, the largest sizes' noise would swamp the
    intercept, which the smallest sizes measure."""
    ws = [1.0 / (x * x) for x in xs]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    b = sxy / sxx if sxx else 0.0
    return my - b * mx, b


def fit_with_interval(
    xs: Sequence[float], ys: Sequence[float], seed: int, resamples: int = 2000
) -> dict[str, Any]:
    """The line's intercept (seconds) and slope (s/byte), with a 95% bootstrap interval
    of the intercept (points resampled with replacement)."""
    a, b = fit_line(xs, ys)
    rng = random.Random(seed)
    pts = list(zip(xs, ys, strict=True))
    got = []
    for _ in range(resamples):
        pick = [pts[rng.randrange(len(pts))] for _ in pts]
        if len({x for x, _ in pick}) < 2:
            continue  # one size only: no line
        got.append(fit_line([x for x, _ in pick], [y for _, y in pick])[0])
    got.sort()
    lo = got[int(0.025 * (len(got) - 1))] if got else a
    hi = got[int(0.975 * (len(got) - 1))] if got else a
    return {"intercept_s": a, "intercept_95_s": [lo, hi], "slope_s_per_byte": b}


def trace_span(events: Sequence[Sequence[int]], t_trace: float) -> dict[str, float] | None:
    """The engine's first request to the kernel and last completion, as perf_counter
    times (the trace counts from its start; `t_trace` was taken just before it, so these
    are at most microseconds early)."""
    if not events:
        return None
    return {
        "first_kernel_submit": t_trace + min(e[3] for e in events) / 1e9,
        "last_complete": t_trace + max(e[4] for e in events) / 1e9,
        "requests": float(len(events)),
        "max_depth": float(max(e[5] for e in events)),
    }


def phases(
    t0: float,
    plan_timings: dict[str, float],
    marks: dict[str, float],
    span: dict[str, float] | None,
    t_end: float,
) -> dict[str, float]:
    """Milliseconds of one restore (probe at `t0` to restore done at `t_end`) by phase.

    discovery, agreement: the probe. setup: the restore's start to chunk 0's read handed
    to the engine (vote, window, registration: "registration" on its own where it ran).
    to_kernel: from there to the first request in the kernel. first_read: chunk 0's read
    (the ramp). stream: chunk 0's landing to the last chunk's. last_chunk: the last
    chunk's hash and install after its read landed (nothing overlaps it). after_drive:
    the last completion to the install's end (the unoverlapped tail as the drive sees
    it). commit: the vote. other: the rest (the caller's own steps)."""
    ms = 1e3
    out = {
        "discovery": plan_timings.get("discover_s", 0.0) * ms,
        "agreement": plan_timings.get("agree_s", 0.0) * ms,
    }
    first = marks.get("first_submitted")
    if first is None or "start" not in marks:
        return out
    out["setup"] = (first - marks["start"]) * ms
    if "registered" in marks:
        out["registration"] = (marks["registered"] - marks["begin"]) * ms
    if span is not None:
        out["to_kernel"] = (span["first_kernel_submit"] - first) * ms
        out["after_drive"] = (marks["end"] - span["last_complete"]) * ms
        out["drive_busy"] = (span["last_complete"] - span["first_kernel_submit"]) * ms
    out["first_read"] = (marks["first_hash"] - first) * ms
    out["stream"] = (marks["last_hash"] - marks["first_hash"]) * ms
    out["last_chunk"] = (marks["end"] - marks["last_hash"]) * ms
    out["commit"] = (marks["committed"] - marks["installed"]) * ms
    listed = ("discovery", "agreement", "setup", "first_read", "stream", "last_chunk", "commit")
    out["other"] = (t_end - t0) * ms - sum(out[k] for k in listed)
    return out


def median_phases(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: statistics.median(r[k] for r in rows if k in r) for k in sorted(keys)}

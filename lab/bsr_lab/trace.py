"""Reading request traces: the engine's (`Engine.trace_take`) and fio's per-I/O latency
log, summarised the same way so `bench ssd --trace` can set them side by side.

Throughput is depth x request size / latency (Little's law), so when the engine trails
fio one of three things differs: fewer requests in flight (bubbles: the consumer or
the I/O thread late to refill), each request taking longer at the same depth (the
device or the request shape), or time outside the requests (start and end).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

# (offset, bytes, queued_ns, submit_ns, complete_ns, depth, waiting), from trace_take
EngineEvent = tuple[int, int, int, int, int, int, int]


def _pcts(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}

    def at(q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))]

    return {
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": v[-1],
        "mean": statistics.fmean(v),
    }


def _little(lat_ns: list[int], span_ns: int, nbytes: int) -> dict[str, Any]:
    span = max(span_ns, 1)
    return {
        "requests": len(lat_ns),
        "span_s": span / 1e9,
        "gib_s_in_span": nbytes / (span / 1e9) / (1 << 30),
        # Little's law: the mean number in flight over the span.
        "mean_depth": sum(lat_ns) / span,
        "latency_ms": {k: x / 1e6 for k, x in _pcts([float(x) for x in lat_ns]).items()},
    }


def engine_summary(events: list[EngineEvent], queue_depth: int) -> dict[str, Any]:
    """Depth and latency of one traced engine run, and where the queue ran short."""
    if not events:
        return {"requests": 0}
    start = min(e[3] for e in events)
    end = max(e[4] for e in events)
    out = _little([e[4] - e[3] for e in events], end - start, sum(e[1] for e in events))
    # Sweep: in flight from submit to complete, waiting from queued to submit.
    edges: list[tuple[int, int, int]] = []
    for _, _, q, s, c, _, _ in events:
        edges += [(q, 0, 1), (s, 0, -1), (s, 1, 1), (c, 1, -1)]
    edges.sort()
    full = short_idle = short_queued = 0
    waiting = inflight = 0
    t_prev = start
    for t, which, d in edges:
        if t > t_prev and t_prev >= start:
            dt = min(t, end) - t_prev
            if inflight >= queue_depth:
                full += dt
            elif waiting:
                short_queued += dt
            else:
                short_idle += dt
        t_prev = max(t, start)
        if which == 0:
            waiting += d
        else:
            inflight += d
    span = max(end - start, 1)
    waits = [float(e[3] - e[2]) for e in events]
    out.update(
        {
            "queue_depth": queue_depth,
            # Share of the run at full depth; short with nothing queued (the consumer had
            # not handed the next slot over yet); short with requests queued (the I/O
            # thread late to refill).
            "time_full": full / span,
            "time_short_nothing_queued": short_idle / span,
            "time_short_requests_queued": short_queued / span,
            "queue_wait_ms": {k: x / 1e6 for k, x in _pcts(waits).items()},
            "depth_at_submit": _pcts([float(e[5]) for e in events]),
        }
    )
    return out


def fio_summary(lat_log: Path) -> dict[str, Any]:
    """fio's per-I/O total latency log (`--write_lat_log` with `--log_avg_msec=0`):
    `time_ms, latency_ns, direction, bytes, offset` per line, time at completion."""
    lat: list[int] = []
    ends: list[float] = []
    nbytes = 0
    for line in lat_log.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        t_ms, ns, size = int(parts[0]), int(parts[1]), int(parts[3])
        lat.append(ns)
        ends.append(t_ms * 1e6)
        nbytes += size
    if not lat:
        return {"requests": 0}
    starts = [e - x for e, x in zip(ends, lat, strict=True)]
    out = _little(lat, int(max(ends) - min(starts)), nbytes)
    out["note"] = "fio logs completion times in whole ms: span and depth are +-1 ms"
    return out

"""Reading the vLLM connector's restore traces back (integrations/vllm/trace.py writes
them): per restored request, the segments from lookup to first token and whose each is,
vLLM's protocol or ours. Pure event-log analysis: no vLLM needed, so a bench summary in
any virtualenv can read a serving run's log."""

from __future__ import annotations

from typing import Any

TRACE = "trace"  # the event kind integrations/vllm/trace.py writes

# Segments of a restored request, in order, and whose each is: vLLM's protocol or ours.
SEGMENTS = (
    ("lookup_to_answered", "lookup", "answered", "ours: hashing and discovery, ask-agains"),
    ("answered_to_sent", "answered", "sent", "vLLM: allocation, then the step's metadata"),
    ("sent_to_submitted", "sent", "submitted", "vLLM: the metadata reaching the worker"),
    ("submitted_to_started", "submitted", "started", "ours: the load queued on its lane"),
    ("started_to_read_done", "started", "read_done", "ours: load_records (the drive inside)"),
    ("read_done_to_reported", "read_done", "reported", "vLLM: the worker polls once per step"),
    ("reported_to_learned", "reported", "learned", "vLLM: the step output reaching the scheduler"),
    ("learned_to_scheduled", "learned", "scheduled", "vLLM: the next schedule() takes it"),
    ("scheduled_to_sampled", "scheduled", "sampled", "vLLM: its forward (as for a prefix hit)"),
)


def phases(
    sched: dict[str, Any], worker: list[dict[str, Any]], load: list[dict[str, Any]]
) -> dict[str, Any]:
    """One restored request's segments (ms) and step counts, from its scheduler trace,
    its workers' trace marks and its load events (the slowest rank's, where ranks differ)."""
    at = {k: v["mono"] for k, v in sched["marks"].items()}
    steps = {k: v["step"] for k, v in sched["marks"].items()}
    for mark in ("submitted", "reported"):
        got = [e["mono"] for e in worker if e.get("mark") == mark]
        if got:
            at[mark] = max(got)
    started = [e["started_mono"] for e in load if "started_mono" in e]
    ended = [e["ended_mono"] for e in load if "ended_mono" in e]
    if started and ended:
        at["started"], at["read_done"] = max(started), max(ended)
    out: dict[str, Any] = {}
    for name, a, b, _ in SEGMENTS:
        if a in at and b in at:
            out[name] = round((at[b] - at[a]) * 1e3, 3)
    if "lookup" in at and "sampled" in at:
        out["lookup_to_sampled"] = round((at["sampled"] - at["lookup"]) * 1e3, 3)
    out["steps"] = {
        "lookup_to_sent": _diff(steps, "lookup", "sent"),
        "sent_to_learned": _diff(steps, "sent", "learned"),
        "learned_to_scheduled": _diff(steps, "learned", "scheduled"),
        "sent_to_scheduled": _diff(steps, "sent", "scheduled"),
    }
    out["asks"] = sched.get("asks", 0)
    # Each step from the one that sent the load to the one that scheduled its forward:
    # how long an engine step took while the request waited (start to start, ms).
    if "sent" in at and "scheduled" in at:
        starts = [at["sent"], *sched.get("waits", []), at["scheduled"]]
        out["wait_steps_ms"] = [
            round((b - a) * 1e3, 3) for a, b in zip(starts, starts[1:], strict=False)
        ]
    return out


def _diff(steps: dict[str, int], a: str, b: str) -> int | None:
    return steps[b] - steps[a] if a in steps and b in steps else None

"""Prometheus counters of what the vLLM connector's workers save, on the worker's
registry (`metrics_port` + rank), beside the restore metrics.

Two kinds of save: `step`, a window-group record cut in the step that computed it
(vLLM reuses those blocks from the next step on), written by a writer thread; and
`finish`, a finished request's full-group records, one save job per request. Each
record ends `saved`, `existing` (already stored: not written again), `skipped` (no
save slot within `step_save_budget_s`, or a job that never started by its deadline)
or `failed`; every skipped or failed record is a future miss.

    bsr_io_vllm_save_records_total{kind, outcome}
    bsr_io_vllm_save_seconds{kind}   (a step record's write; a finish job's save)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

SAVED = "saved"
EXISTING = "existing"
SKIPPED = "skipped"
FAILED = "failed"

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SaveMetrics:
    def __init__(self, registry: CollectorRegistry, namespace: str = "bsr_io") -> None:
        self.records = Counter(
            "vllm_save_records",
            "Records the vLLM connector saved, found stored, skipped or failed to save",
            ["kind", "outcome"],
            namespace=namespace,
            registry=registry,
        )
        self.seconds = Histogram(
            "vllm_save_seconds",
            "Time of one save: a step record's write, or a finished request's save job",
            ["kind"],
            buckets=_BUCKETS,
            namespace=namespace,
            registry=registry,
        )

    def step(self, outcome: str, seconds: float | None = None) -> None:
        self.records.labels("step", outcome).inc()
        if seconds is not None:
            self.seconds.labels("step").observe(seconds)

    def finish(
        self, records: int, written: int, failed: int, seconds: float | None, started: bool
    ) -> None:
        """A finish save job's end: `records` this rank owns, `written` of them written,
        `failed` not; the rest were stored already. A job that never `started` skipped
        all of its records."""
        if not started:
            self.records.labels("finish", SKIPPED).inc(records)
            return
        self.records.labels("finish", SAVED).inc(written)
        self.records.labels("finish", FAILED).inc(failed)
        self.records.labels("finish", EXISTING).inc(max(0, records - written - failed))
        if seconds is not None:
            self.seconds.labels("finish").observe(seconds)

"""Prometheus metrics for restores.

`RestoreMetrics` records each `RestoreResult` into counters and histograms on a
registry of its own (or the one given), so a serving engine can mount it with
`make_wsgi_app()` / `start_http_server()` or merge it into its registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bsr_io.load.records import RestoreResult

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class RestoreMetrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "bsr_io"
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r, ns = self.registry, namespace
        self.restores = Counter(
            "restores", "Restores by outcome", ["outcome"], namespace=ns, registry=r
        )
        self.fallbacks = Counter(
            "fallbacks", "Chunks read again from a lower tier", ["tier"], namespace=ns, registry=r
        )
        self.bytes_read = Counter(
            "read_bytes", "Chunk bytes read per tier", ["tier"], namespace=ns, registry=r
        )
        self.committed_tokens = Counter(
            "committed_tokens", "Tokens committed by restores", namespace=ns, registry=r
        )
        self.rws_peak = Gauge(
            "rws_peak_bytes", "Staging peak of the last restore", namespace=ns, registry=r
        )
        self.latency = Histogram(
            "restore_seconds",
            "Time from restore start to commit decision",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            namespace=ns,
            registry=r,
        )

    def observe(self, result: RestoreResult) -> None:
        self.restores.labels(result.outcome).inc()
        for fb in result.fallbacks:
            self.fallbacks.labels(fb.get("tier", "none")).inc()
        for tier, n in result.bytes_read.items():
            self.bytes_read.labels(tier).inc(n)
        self.committed_tokens.inc(result.committed_tokens)
        self.rws_peak.set(result.rws_peak_bytes)
        total = result.timings.get("total_s")
        if total is not None:
            self.latency.labels(result.outcome).observe(total)

    def snapshot(self) -> dict[str, float]:
        """Current sample values, flat, for `--json` outputs."""
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def exposition(self) -> bytes:
        """The Prometheus text format of this registry."""
        return generate_latest(self.registry)

"""The collector's own health, in Prometheus format at /metrics."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SelfMetrics:
    """Counters of what was received, rejected and committed."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rankwatch_collector_requests",
            "OTLP export requests by signal and HTTP status",
            ["signal", "code"],
            registry=self.registry,
        )
        self.token_checks = Counter(
            "rankwatch_collector_token_checks",
            "Empty OTLP exports refused (a launcher's or agent's check of its token: no telemetry lost) by HTTP status",
            ["code"],
            registry=self.registry,
        )
        self.received = Counter(
            "rankwatch_collector_items_received",
            "Spans, data points and log records stored",
            ["signal"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "rankwatch_collector_items_rejected",
            "Items refused (partial success) or in refused requests",
            ["signal"],
            registry=self.registry,
        )
        self.duplicates = Counter(
            "rankwatch_collector_duplicate_requests",
            "Retried exports acknowledged without writing again",
            ["signal"],
            registry=self.registry,
        )
        self.queue_bytes = Gauge(
            "rankwatch_collector_queue_bytes", "Request bytes admitted and not yet committed", registry=self.registry
        )
        self.commit_seconds = Histogram(
            "rankwatch_collector_commit_seconds",
            "Group commit latency",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.commit_rows = Counter(
            "rankwatch_collector_rows_committed", "Rows appended to telemetry tables", registry=self.registry
        )

    def health(self) -> dict:
        """The counters the collector's health is judged on (collector/analysis/analyzers/health.py): export
        requests by HTTP status, and group commits by duration bucket, each a total since the start."""
        requests: dict[int, int] = {}
        (family,) = self.requests.collect()
        for sample in family.samples:
            if sample.name.endswith("_total"):
                code = int(sample.labels["code"])
                requests[code] = requests.get(code, 0) + int(sample.value)
        (family,) = self.commit_seconds.collect()
        commits = {
            float(sample.labels["le"]): int(sample.value)
            for sample in family.samples
            if sample.name.endswith("_bucket")
        }
        return {"requests": requests, "commits": commits}

    def observe_commit(self, seconds: float, rows: int) -> None:
        self.commit_seconds.observe(seconds)
        self.commit_rows.inc(rows)

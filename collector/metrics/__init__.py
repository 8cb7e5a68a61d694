"""Prometheus metrics at /metrics: per-run fleet aggregates and the collector's own health."""

"""Analyzers: pure functions from telemetry tables to findings."""

"""Receiving telemetry: HTTP bodies and the bearer token, OTLP/HTTP, decoding, ingest, and traces
imported from files."""

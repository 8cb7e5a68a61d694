"""OTLP receiver, DuckDB store, analyzers and APIs."""

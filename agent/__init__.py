"""In-process instrumentation for training ranks (imports no collector code)."""

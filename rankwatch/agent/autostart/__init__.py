"""The directory `rankwatch run` puts on a job's PYTHONPATH: its `sitecustomize` instruments each
Python process of the job (rankwatch/agent/auto.py)."""

"""Run by Python at the start of every process of a job under `rankwatch run` (this directory is on
its PYTHONPATH): the agent waits for the script to import torch (rankwatch/agent/auto.py). The
sitecustomize this one shadows, if the environment has one, runs after it."""

import importlib.machinery
import importlib.util
import os
import sys


def _next_sitecustomize() -> None:
    """Run the sitecustomize found further down sys.path, as Python would have without this one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get("RANKWATCH_AUTO"):
    try:
        from rankwatch.agent import auto

        auto.install()
    except ImportError as e:  # the job's Python lacks rankwatch: it runs as it would have, and says so
        print(f"rankwatch: this process is not instrumented (rankwatch is not installed for it: {e})", file=sys.stderr)
_next_sitecustomize()

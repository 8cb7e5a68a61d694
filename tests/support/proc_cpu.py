"""A process's CPU time as Linux counts it, read from /proc: what a bench measures of processes it did not
start in its own interpreter (a collector, a node sidecar), whose `getrusage` it cannot ask."""

import os
from pathlib import Path


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far, all its threads; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

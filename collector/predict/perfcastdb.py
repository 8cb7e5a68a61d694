"""PerfCastDB (NCPP's data set): a server's benchmark score from its hardware characteristics.

One row is one result (`RESULT.Value` of `RESULT.TestName` in `RESULT.WorkloadName`) on one server
(`kubernetes.pod_id`), with the server's characteristics. Columns go to NCPP's four groups by their
prefix; the rest (ids, timestamps, the host, the iteration) describe no hardware and are left out.
"""

from pathlib import Path

import numpy as np
import pandas as pd

SERVER, TARGET = "kubernetes.pod_id", "RESULT.Value"
WORKLOAD = ["RESULT.WorkloadName", "RESULT.TestName", "RESULT.WorkloadPreset", "RESULT.WorkloadVersion"]
CONFIGURATION = WORKLOAD[:2]  # what a per-configuration median groups by, the coarsest last
_GROUPS = {  # group: column prefixes (the first group a column matches wins)
    "memory": ("SVR.Memory.", "META.metadata.cscope.MEMINFO.", "Measure.DIMM.", "DIMM."),
    "processor": ("SVR.CPU.", "SVR.ISA", "SVR.Accelerators", "META.metadata.cscope.", "CPU."),
    "system": ("SVR.Power.", "SVR.System.", "SVR.Drive", "BIOS.", "RESULT.cluster-name", "Power.", "System."),
}
_NOT_HARDWARE = ("BIOS.kubernetes.pod_id", "SVR.CPU.On-line CPU(s) List")


class DataError(ValueError):
    """A file that is not PerfCastDB's format: said in one line."""


def groups(columns: list[str]) -> dict[str, list[str]]:
    """The file's columns in NCPP's groups: processor, memory, system, workload."""
    out: dict[str, list[str]] = {"processor": [], "memory": [], "system": [], "workload": []}
    for name in columns:
        if name in _NOT_HARDWARE:
            continue
        if name in WORKLOAD:
            out["workload"].append(name)
            continue
        group = next((g for g, prefixes in _GROUPS.items() if name.startswith(prefixes)), None)
        if group:
            out[group].append(name)
    return out


def load(path: Path) -> tuple[pd.DataFrame, np.ndarray]:
    """The file's rows with a positive score, and the scores."""
    try:
        table = pd.read_csv(path, low_memory=False)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as CSV ({e})") from None
    missing = [c for c in (SERVER, TARGET, *CONFIGURATION) if c not in table]
    if missing:
        raise DataError(f"{path}: not PerfCastDB's format, it lacks the column(s) {', '.join(missing)}")
    score = pd.to_numeric(table[TARGET], errors="coerce")
    table = table[score > 0].reset_index(drop=True)
    if table.empty:
        raise DataError(f"{path}: no row has a positive {TARGET}")
    return table, score[score > 0].to_numpy(dtype=float)

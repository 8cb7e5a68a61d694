"""A job that stopped itself rather than roll back once more (its rollback budget spent,
trainer/rollback.py): nothing automatic is left to do, so a person must look. A pure function
of the run's failed rollback commands and the last step it reported."""

import pandas as pd

from collector.analysis.analyzers import Frames, Reads
from collector.findings import Finding

ANALYZER = "rollbacks"
# a job stopped by its rollback budget has ended; that it stopped is what a person must read
READS = Reads(history=0, linger=1, every_pass=True, ends_with_run=False, failed_rollbacks=True)


def judge(frames: Frames, settings: None = None) -> list[Finding]:
    """The job's stop, while no step came after it."""
    return analyze(frames.failed_rollbacks, frames.last)


def analyze(failed: pd.DataFrame, last_step: int) -> list[Finding]:
    """A critical `stopped` finding for the newest rollback the job refused and stopped at,
    while no step came after it (a job resumed by a person resolves it).

    `failed`: run_id, id, finding_id, result (dict: `why`, `from_step`, `restored_step`) of the
    run's failed rollback commands. Failures without `restored_step` are those with no
    checkpoint far enough back: the job trained on, and its anomaly finding says so."""
    stopped = failed[failed["result"].map(lambda r: bool(r) and r.get("restored_step") is not None)]
    if stopped.empty:
        return []
    newest = stopped.sort_values("id").iloc[-1]
    result = newest["result"]
    if last_step > int(result["from_step"]):
        return []
    return [
        Finding(
            str(newest["run_id"]),
            "stopped",
            [],
            int(result["restored_step"]),
            int(result["from_step"]),
            "critical",
            1.0,
            f"the job stopped at step {result['from_step']} instead of another rollback: {result['why']}",
            {
                "command": int(newest["id"]),
                "anomaly_finding": None if pd.isna(newest["finding_id"]) else int(newest["finding_id"]),
                **result,
            },
            analyzer=ANALYZER,
        )
    ]

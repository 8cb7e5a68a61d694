"""Control commands for a running job: rollbacks and power caps.

A command is created by an analyzer (a rollback for each anomaly finding, at
most one per finding) or by a person through the control API, fetched by the
job's agent while `pending`, and moved by the job to `acked` (with the step
at which every rank will apply it), then `applied` or `failed` (with what
happened, in `result`). These functions run in the store's writer process,
the one process with the store open for writing.
"""

import json
from dataclasses import dataclass

import duckdb

from collector.analyzers import anomalies

KINDS = ("rollback", "power_cap")
STATES = ("pending", "acked", "applied", "failed", "cancelled")
_COLUMNS = "id, run_id, kind, args, state, created_by, finding_id, apply_step, result, created_at, updated_at"


@dataclass(frozen=True)
class RollbackPolicy:
    """How an anomaly is rolled back: to a checkpoint at least `margin` steps before it began,
    skipping the `skip_batches` batches that led to it, the learning rate scaled by `lr_scale`."""

    margin: int = 5
    skip_batches: int = 20
    lr_scale: float = 1.0


class CommandError(ValueError):
    """A request the control API refuses (400), or LookupError for an unknown command (404)."""


def create(con: duckdb.DuckDBPyConnection, run_id: str, kind: str, args: dict, created_by: str,
           finding_id: int | None = None) -> dict:
    """A new pending command; for a finding that already has one, that one (one anomaly, one rollback)."""
    if kind not in KINDS:
        raise CommandError(f"unknown command kind {kind!r}; kinds: {', '.join(KINDS)}")
    if kind == "power_cap":
        args = power_cap_args(args)
    if finding_id is not None:
        existing = _select(con, "WHERE finding_id = ? AND kind = ?", [finding_id, kind])
        if existing:
            return existing[0]
    (command_id,) = con.execute("INSERT INTO commands (run_id, kind, args, created_by, finding_id) "
                                "VALUES (?, ?, ?, ?, ?) RETURNING id",
                                [run_id, kind, json.dumps(args), created_by, finding_id]).fetchone()
    return get(con, command_id)


def power_cap_args(args) -> dict:
    """A power cap's args as the job reads them: `caps` {rank: W} (rank as a string, as JSON has
    it) and `watts` for every other rank, either or both; CommandError for anything else."""
    usage = "a power_cap takes caps {rank: watts} and/or watts (every other rank), ranks >= 0, watts positive"
    if not isinstance(args, dict) or set(args) - {"caps", "watts"} or not isinstance(args.get("caps", {}), dict):
        raise CommandError(usage)
    try:
        caps = {str(int(rank)): float(w) for rank, w in args.get("caps", {}).items()}
        watts = [float(args["watts"])] if args.get("watts") is not None else []
    except (TypeError, ValueError):
        raise CommandError(usage) from None
    if not (caps or watts) or any(int(r) < 0 for r in caps) or not all(w > 0 for w in [*caps.values(), *watts]):
        raise CommandError(usage)
    return {"caps": caps} | ({"watts": watts[0]} if watts else {})


def get(con: duckdb.DuckDBPyConnection, command_id: int) -> dict:
    rows = _select(con, "WHERE id = ?", [command_id])
    if not rows:
        raise LookupError(f"no command {command_id}")
    return rows[0]


def listing(con: duckdb.DuckDBPyConnection, run_id: str, state: str | None = None) -> list[dict]:
    """A run's commands, oldest first; only those in `state` when given."""
    if state is not None and state not in STATES:
        raise CommandError(f"unknown state {state!r}; states: {', '.join(STATES)}")
    return _select(con, "WHERE run_id = ?" + (" AND state = ?" if state else "") + " ORDER BY id",
                   [run_id, state] if state else [run_id])


def update(con: duckdb.DuckDBPyConnection, command_id: int, state: str, apply_step: int | None = None,
           result: dict | None = None) -> dict:
    """Move a command on; a command that is applied, failed or cancelled stays so."""
    if state not in STATES:
        raise CommandError(f"unknown state {state!r}; states: {', '.join(STATES)}")
    current = get(con, command_id)
    if current["state"] in ("applied", "failed", "cancelled") and current["state"] != state:
        raise CommandError(f"command {command_id} is already {current['state']}")
    con.execute("UPDATE commands SET state = ?, apply_step = coalesce(?, apply_step), "
                "result = coalesce(?, result), updated_at = now() WHERE id = ?",
                [state, apply_step, None if result is None else json.dumps(result), command_id])
    return get(con, command_id)


# Firing anomaly findings no rollback has answered: none was sent for them, nor for another
# finding of the same step drawn before that rollback was done with (the same anomaly; one drawn
# later at that step is the anomaly coming back on the new trajectory).
_UNANSWERED = """
SELECT f.id, f.kind, f.step_start FROM findings f
WHERE f.run_id = ? AND f.analyzer = ? AND f.state = 'firing'
  AND NOT EXISTS (SELECT 1 FROM commands c JOIN findings answered ON c.finding_id = answered.id
                  WHERE c.run_id = f.run_id AND (answered.id = f.id OR (answered.step_start = f.step_start
                                                                         AND f.created_at <= c.updated_at)))
"""


def rollbacks_for_anomalies(con: duckdb.DuckDBPyConnection, run_id: str, policy: RollbackPolicy) -> list[dict]:
    """A rollback for the run's firing anomaly findings that have none yet, back before the
    earliest, unless one is under way: one anomaly often shows as several findings (a loss spike
    with its gradient-norm spike), and one rollback ends them all, or, failing, answers them all."""
    if con.execute("SELECT 1 FROM commands WHERE run_id = ? AND kind = 'rollback' AND state IN ('pending', 'acked')",
                   [run_id]).fetchone():
        return []
    findings = con.execute(_UNANSWERED, [run_id, anomalies.ANALYZER]).fetchall()
    if not findings:
        return []
    finding_id, kind, step_start = min(findings, key=lambda f: f[2])  # the earliest: one rollback covers all
    return [create(con, run_id, "rollback", {"before_step": step_start - policy.margin, "anomaly": kind,
                                             "skip_batches": policy.skip_batches, "lr_scale": policy.lr_scale},
                   "anomalies", finding_id)]


def _select(con: duckdb.DuckDBPyConnection, where: str, params: list) -> list[dict]:
    cursor = con.execute(f"SELECT {_COLUMNS} FROM commands {where}", params)
    names = [d[0] for d in cursor.description]
    rows = []
    for row in cursor.fetchall():
        command = dict(zip(names, row))
        for column in ("args", "result"):
            command[column] = json.loads(command[column]) if command[column] else None
        for column in ("created_at", "updated_at"):
            command[column] = command[column].isoformat()
        rows.append(command)
    return rows


# What the control API may ask of the writer process, by name.
OPERATIONS = {"create": create, "get": get, "listing": listing, "update": update}

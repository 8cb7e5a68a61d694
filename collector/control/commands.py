"""Control commands for a running job: rollbacks and power caps.

A command is created by an analyzer (a rollback for each anomaly finding, at
most one per finding) or by a person through the control API, fetched by the
job's agent while `pending`, and moved by the job to `acked` (with the step
at which every rank will apply it), then `applied` or `failed` (with what
happened, in `result`). These functions run in the store's writer process,
the one process with the store open for writing: the control API sends them
as requests (CreateCommand, ListCommands, UpdateCommand), answered on the
writer thread between commits.
"""

import json
import math
from dataclasses import dataclass

import duckdb

from collector.analysis.analyzers import anomalies
from collector.receive.decode import RANGES
from collector.store.lake import next_id
from collector.store.requests import Context, Request, handles

KINDS = ("rollback", "power_cap")
STATES = ("pending", "acked", "applied", "failed", "cancelled")
MAX_STEP, MAX_RANK = RANGES["step"], RANGES["rank"]  # steps and ranks as ingest takes them: [0, MAX)
# What a job can sanely be told to do. A power cap's watts: from below the lowest limit any data-center GPU
# takes (tens of watts, the smallest inference cards') to above the highest (about 1,400 W); the job clamps
# a cap to its own GPU's range too. A rollback's lr_scale lowers the learning rate or keeps it, to a
# hundredth at most (a raised rate is what diverges; below a hundredth, training all but stops); its
# skip_batches, in [0, MAX_SKIP_BATCHES), are the batches that led to the anomaly: those since the
# checkpoint restored, a few checkpoint intervals (100 steps by default), never the rest of the data.
MIN_WATTS, MAX_WATTS = 25.0, 2_000.0
MIN_LR_SCALE, MAX_LR_SCALE = 0.01, 1.0
MAX_SKIP_BATCHES = 10_000
MAX_TEXT = 256  # characters of a run id or an anomaly's name
_COLUMNS = "id, run_id, kind, args, state, created_by, finding_id, apply_step, result, created_at, updated_at"


# The anomalies (anomalies.py's kinds) a rollback answers unless asked otherwise: a non-finite value
# and a loss spike. A gradient-norm spike alone is a warning: in early training the norm swings by
# 2x while the loss keeps falling (a GPT-2 run on an H100 was rolled back twice for such swings
# before any fault, and then stopped by its rollback budget), so rolling back on it is opt-in.
ROLLBACK_ON = frozenset({"nan", "loss_spike"})


@dataclass(frozen=True)
class RollbackPolicy:
    """How an anomaly is rolled back: to a checkpoint at least `margin` steps before it began,
    skipping the `skip_batches` batches that led to it, the learning rate scaled by `lr_scale`;
    `on`: the anomaly kinds that are rolled back (the others are only reported)."""

    margin: int = 5
    skip_batches: int = 20
    lr_scale: float = 1.0
    on: frozenset[str] = ROLLBACK_ON


class CommandError(ValueError):
    """A request the control API refuses (400), or LookupError for an unknown command (404)."""


def create(
    con: duckdb.DuckDBPyConnection, run_id: str, kind: str, args: dict, created_by: str, finding_id: int | None = None
) -> dict:
    """A new pending command; for a finding that already has one, that one (one anomaly, one rollback).
    CommandError, with one line, for a run id, kind or args the job could not act on."""
    _check_run_id(run_id)
    if kind not in KINDS:
        raise CommandError(f"unknown command kind {_shown(kind)}; kinds: {', '.join(KINDS)}")
    args = (power_cap_args if kind == "power_cap" else rollback_args)(args)
    if finding_id is not None:
        existing = _select(con, "WHERE finding_id = ? AND kind = ?", [finding_id, kind])
        if existing:
            return existing[0]
    command_id = next_id(con, "commands_id")
    con.execute(
        "INSERT INTO commands (id, run_id, kind, args, created_by, finding_id) VALUES (?, ?, ?, ?, ?, ?)",
        [command_id, run_id, kind, json.dumps(args), created_by, finding_id],
    )
    return get(con, command_id)


def rollback_args(args) -> dict:
    """A rollback's args as the job reads them: `before_step` (the newest checkpoint at or before it
    is restored; below 0 when the anomaly came within the margin of the start), and optionally
    `skip_batches`, `lr_scale` and `anomaly` (what was seen); CommandError for anything else."""
    if not isinstance(args, dict) or "before_step" not in args:
        raise CommandError("a rollback takes args {before_step, skip_batches?, lr_scale?, anomaly?}")
    if unknown := sorted(set(args) - {"before_step", "skip_batches", "lr_scale", "anomaly"}):
        raise CommandError(
            f"a rollback takes no {_shown(unknown[0])}; args: before_step, skip_batches?, lr_scale?, anomaly?"
        )
    _integer(args["before_step"], "before_step", -MAX_STEP, MAX_STEP)
    _integer(args.get("skip_batches", 0), "skip_batches", 0, MAX_SKIP_BATCHES)
    _number(args.get("lr_scale", 1.0), "lr_scale", MIN_LR_SCALE, MAX_LR_SCALE)
    if not isinstance(args.get("anomaly", ""), str) or len(args.get("anomaly", "")) > MAX_TEXT:
        raise CommandError(f"anomaly must be a string of at most {MAX_TEXT} characters")
    return args


def power_cap_args(args) -> dict:
    """A power cap's args as the job reads them: `caps` {rank: W} (rank as a string, as JSON has
    it) and `watts` for every other rank, either or both; CommandError for anything else."""
    usage = (
        f"a power_cap takes caps {{rank: watts}} and/or watts (every other rank), ranks in [0, {MAX_RANK}), "
        f"watts in [{MIN_WATTS:g}, {MAX_WATTS:g}]"
    )
    if not isinstance(args, dict) or set(args) - {"caps", "watts"} or not isinstance(args.get("caps", {}), dict):
        raise CommandError(usage)
    caps, watts = args.get("caps", {}), args.get("watts")
    try:
        caps = {_rank(rank): _number(w, "watts", MIN_WATTS, MAX_WATTS) for rank, w in caps.items()}
        watts = None if watts is None else _number(watts, "watts", MIN_WATTS, MAX_WATTS)
    except CommandError:
        raise CommandError(usage) from None
    if not caps and watts is None:
        raise CommandError(usage)
    return {"caps": caps} | ({"watts": watts} if watts is not None else {})


def _check_run_id(run_id) -> None:
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_TEXT:
        raise CommandError(f"run_id must be a string of 1 to {MAX_TEXT} characters")


def _rank(key) -> str:
    """A caps key as the job looks it up: a rank in [0, MAX_RANK) in decimal digits, without leading zeros."""
    text = str(key)
    if not (text.isascii() and text.isdigit() and len(text) <= 8 and int(text) < MAX_RANK):
        raise CommandError(f"rank {_shown(key)} is not in [0, {MAX_RANK})")
    return str(int(text))


def _integer(value, name: str, low: int, high: int) -> int:
    """`value` when it is an integer in [low, high); CommandError otherwise (a bool is no integer)."""
    if type(value) is not int or not low <= value < high:
        raise CommandError(f"{name} must be an integer in [{low}, {high}), not {_shown(value)}")
    return value


def _number(value, name: str, low: float, high: float) -> float:
    """`value` as a float when it is a number in [low, high]; CommandError otherwise (a bool is no number,
    and NaN fails the comparison)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise CommandError(f"{name} must be a number in [{low:g}, {high:g}], not {_shown(value)}")
    return float(value)


def _shown(value) -> str:
    """A value for an error message: its repr, cut short (one line, whatever was sent)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def get(con: duckdb.DuckDBPyConnection, command_id: int) -> dict:
    rows = _select(con, "WHERE id = ?", [command_id])
    if not rows:
        raise LookupError(f"no command {command_id}")
    return rows[0]


def listing(con: duckdb.DuckDBPyConnection, run_id: str, state: str | None = None) -> list[dict]:
    """A run's commands, oldest first; only those in `state` when given."""
    _check_run_id(run_id)
    if state is not None and state not in STATES:
        raise CommandError(f"unknown state {_shown(state)}; states: {', '.join(STATES)}")
    return _select(
        con,
        "WHERE run_id = ?" + (" AND state = ?" if state else "") + " ORDER BY id",
        [run_id, state] if state else [run_id],
    )


def pending_runs(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> list[str]:
    """Which of `run_ids` have a pending command: what the control API's held polls wait for."""
    return [
        run_id
        for (run_id,) in con.execute(
            "SELECT DISTINCT run_id FROM commands WHERE state = 'pending' AND list_contains(?, run_id)", [run_ids]
        ).fetchall()
    ]


def update(
    con: duckdb.DuckDBPyConnection,
    command_id: int,
    state: str,
    apply_step: int | None = None,
    result: dict | None = None,
) -> dict:
    """Move a command on (`apply_step`: the step the job applies it at; `result`: what happened);
    a command that is applied, failed or cancelled stays so."""
    if state not in STATES:
        raise CommandError(f"unknown state {_shown(state)}; states: {', '.join(STATES)}")
    if apply_step is not None:
        _integer(apply_step, "apply_step", 0, MAX_STEP)
    if result is not None and not isinstance(result, dict):
        raise CommandError(f"result must be a JSON object, not {_shown(result)}")
    current = get(con, command_id)
    if current["state"] in ("applied", "failed", "cancelled") and current["state"] != state:
        raise CommandError(f"command {command_id} is already {current['state']}")
    con.execute(
        "UPDATE commands SET state = ?, apply_step = coalesce(?, apply_step), "
        "result = coalesce(?, result), updated_at = now() WHERE id = ?",
        [state, apply_step, None if result is None else json.dumps(result), command_id],
    )
    return get(con, command_id)


# Firing anomaly findings no rollback has answered: none was sent for them, nor for another
# finding at that step or later drawn before that rollback was done with (the same anomaly, or
# the steps the job ran on before the rollback landed, which it abandoned: they must not spend
# the job's rollback budget; one drawn later is an anomaly of the new trajectory). Firing, or
# resolved in the pass that drew it (created and updated at once): at a fast step rate one export
# can bring a spike and more clean steps after it than an anomaly stays firing for.
_UNANSWERED = """
SELECT f.id, f.kind, f.step_start FROM findings f
WHERE f.run_id = ? AND f.analyzer = ? AND (f.state = 'firing' OR f.created_at = f.updated_at)
  AND NOT EXISTS (SELECT 1 FROM commands c JOIN findings answered ON c.finding_id = answered.id
                  WHERE c.run_id = f.run_id AND (answered.id = f.id OR (answered.step_start <= f.step_start
                                                                         AND f.created_at <= c.updated_at)))
"""


def rollbacks_for_anomalies(con: duckdb.DuckDBPyConnection, run_id: str, policy: RollbackPolicy) -> list[dict]:
    """A rollback for the run's firing anomaly findings that have none yet, back before the
    earliest, unless one is under way: one anomaly often shows as several findings (a loss spike
    with its gradient-norm spike), and one rollback ends them all, or, failing, answers them all."""
    if con.execute(
        "SELECT 1 FROM commands WHERE run_id = ? AND kind = 'rollback' AND state IN ('pending', 'acked')", [run_id]
    ).fetchone():
        return []
    findings = [f for f in con.execute(_UNANSWERED, [run_id, anomalies.ANALYZER]).fetchall() if f[1] in policy.on]
    if not findings:
        return []
    finding_id, kind, step_start = min(findings, key=lambda f: f[2])  # the earliest: one rollback covers all
    return [
        create(
            con,
            run_id,
            "rollback",
            {
                "before_step": step_start - policy.margin,
                "anomaly": kind,
                "skip_batches": policy.skip_batches,
                "lr_scale": policy.lr_scale,
            },
            "anomalies",
            finding_id,
        )
    ]


def _select(con: duckdb.DuckDBPyConnection, where: str, params: list) -> list[dict]:
    cursor = con.execute(f"SELECT {_COLUMNS} FROM commands {where}", params)
    names = [d[0] for d in cursor.description]
    rows = []
    for row in cursor.fetchall():
        command = dict(zip(names, row))
        for column in ("args", "result"):
            command[column] = _stored(command[column])
        for column in ("created_at", "updated_at"):
            command[column] = command[column].isoformat()
        rows.append(command)
    return rows


def _stored(text: str | None):
    """A stored JSON value as an answer can carry it, whatever was stored before requests were
    checked: a number that is not finite reads as null (as NaN attributes are stored), and a value
    JSON cannot carry at all as None, so that one such row never breaks the answers for its run."""
    if not text:
        return None
    try:
        value = json.loads(text, parse_constant=lambda _: None, parse_float=_finite_or_none)
        json.dumps(value, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return value


def _finite_or_none(text: str) -> float | None:
    number = float(text)
    return number if math.isfinite(number) else None


# The control API's requests: each answered by the function above of its name, on the writer thread (a
# held poll's check for pending commands beside it, on a cursor of its own);
# a refusal (CommandError, 400) or an unknown command (LookupError, 404) reaches the API as it is.
_REFUSALS = (CommandError, LookupError)


@dataclass(frozen=True)
class CreateCommand(Request[dict]):
    """A person's command (create)."""

    run_id: str
    kind: str
    args: dict
    created_by: str


@dataclass(frozen=True)
class ListCommands(Request[list[dict]]):
    """A run's commands (listing)."""

    run_id: str
    state: str | None = None


@dataclass(frozen=True)
class UpdateCommand(Request[dict]):
    """A job's report of a command's progress (update)."""

    command_id: int
    state: str
    apply_step: int | None = None
    result: dict | None = None


@dataclass(frozen=True)
class PendingRuns(Request[list[str]]):
    """Which of `run_ids` have a pending command (the control API's held polls)."""

    run_ids: list[str]


@handles(CreateCommand, passes=_REFUSALS)
def _create(context: Context, r: CreateCommand) -> dict:
    return create(context.con, r.run_id, r.kind, r.args, r.created_by)


@handles(ListCommands, passes=_REFUSALS)
def _listing(context: Context, r: ListCommands) -> list[dict]:
    return listing(context.con, r.run_id, r.state)


@handles(UpdateCommand, passes=_REFUSALS)
def _update(context: Context, r: UpdateCommand) -> dict:
    return update(context.con, r.command_id, r.state, r.apply_step, r.result)


@handles(PendingRuns, beside=True)
def _pending_runs(context: Context, r: PendingRuns) -> list[str]:
    return pending_runs(context.con, r.run_ids)

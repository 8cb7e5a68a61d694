"""Control commands for a running job: rollbacks, power caps, and requests for every rank's stacks.

A command is created by an analyzer (a rollback for each anomaly finding, at
most one per finding) or by a person through the control API, fetched by the
job's agent while `pending`, and moved by the job to `acked` (with the step
at which every rank will apply it), then `applied` or `failed` (with what
happened, in `result`). A `stacks` command (made by the live analysis when a
hang first fires, one per finding, or by a person) is answered by many ranks
with `rank_stacks` events and never moved by the job: it stays pending for
STACKS_TTL_S, so that pollers late to it still see it, then the collector
settles it (`applied` where every rank asked answered, else `failed` with the
ranks that did not). These functions run in the store's writer process,
the one process with the store open for writing: the control API sends them
as requests (CreateCommand, ListCommands, UpdateCommand), answered on the
writer thread between commits, and the analysis's passes publish their findings
to `Rollbacks` and `StacksRequests` (consumers: collector/findings.py), which
collector/writertasks.py registers.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import duckdb

from collector.analysis.stacks import merge
from collector.findings import ANOMALIES, HANG, HANGS, LOSS_SPIKE, NAN, Consumer, Pass
from collector.receive.decode import RANGES
from collector.store.lake import next_id
from collector.store.requests import Context, Request, handles
from rankwatch.agent.semconv import EVENT_RANK_STACKS

KINDS = ("rollback", "power_cap", "stacks")
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
# A stacks request: pending this long after its creation (every rank answers within seconds, from a thread of
# its own, whatever its training thread does; a poller held elsewhere a while still sees it), then settled;
# the ranks it may name (beyond, ask every rank: `ranks` null)
STACKS_TTL_S = 60.0
MAX_ASKED = 16_384
_COLUMNS = "id, run_id, kind, args, state, created_by, finding_id, apply_step, result, created_at, updated_at"


# The anomalies (analyzers/anomalies.py's kinds) a rollback answers unless asked otherwise: a non-finite value
# and a loss spike. A gradient-norm spike alone is a warning: in early training the norm swings by
# 2x while the loss keeps falling (a GPT-2 run on an H100 was rolled back twice for such swings
# before any fault, and then stopped by its rollback budget), so rolling back on it is opt-in.
ROLLBACK_ON = frozenset({NAN, LOSS_SPIKE})


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
    args = {"power_cap": power_cap_args, "rollback": rollback_args, "stacks": stacks_args}[kind](args)
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


def stacks_args(args) -> dict:
    """A stacks request's args as the ranks read them: `ranks`, the ranks asked (sorted, each once; at most
    MAX_ASKED), or null for every rank; CommandError for anything else."""
    usage = f"a stacks request takes args {{ranks: null (every rank) or a list of 1 to {MAX_ASKED:,} ranks}}"
    if not isinstance(args, dict) or set(args) - {"ranks"}:
        raise CommandError(usage)
    ranks = args.get("ranks")
    if ranks is None:
        return {"ranks": None}
    if not isinstance(ranks, list) or not 0 < len(ranks) <= MAX_ASKED:
        raise CommandError(usage)
    return {"ranks": sorted({_integer(rank, "a rank", 0, MAX_RANK) for rank in ranks})}


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


def listing(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    state: str | None = None,
    kinds: tuple[str, ...] | None = None,
    after: int | None = None,
) -> list[dict]:
    """A run's commands, oldest first; only those in `state`, of `kinds` and with ids above `after`, where
    given (a stacks answerer asks for `stacks` alone, rank 0 for the kinds it acts on; an answerer that
    answered command N asks for those after it)."""
    _check_run_id(run_id)
    if state is not None and state not in STATES:
        raise CommandError(f"unknown state {_shown(state)}; states: {', '.join(STATES)}")
    _check_kinds(kinds)
    filters: dict[str, object] = {"state = ?": state, "list_contains(?, kind)": kinds and list(kinds), "id > ?": after}
    given = {clause: value for clause, value in filters.items() if value is not None}
    return _select(con, " AND ".join(["WHERE run_id = ?", *given]) + " ORDER BY id", [run_id, *given.values()])


def _check_kinds(kinds) -> None:
    if kinds is not None and (not kinds or any(kind not in KINDS for kind in kinds)):
        unknown = next((k for k in kinds if k not in KINDS), "")
        raise CommandError(f"unknown command kind {_shown(unknown)}; kinds: {', '.join(KINDS)}")


# A held poll, as the control API waits on it: (run id, the kinds it asks for or None for any, the id its
# commands come after or None)
Poll = tuple[str, tuple[str, ...] | None, int | None]


def pending_polls(con: duckdb.DuckDBPyConnection, polls: list[Poll]) -> list[Poll]:
    """Which of `polls` have a pending command of theirs: what the control API's held polls wait for."""
    newest = {
        (run_id, kind): newest_id
        for run_id, kind, newest_id in con.execute(
            "SELECT run_id, kind, max(id) FROM commands WHERE state = 'pending' AND list_contains(?, run_id) "
            "GROUP BY run_id, kind",
            [sorted({run_id for run_id, _, _ in polls})],
        ).fetchall()
    }
    return [
        (run_id, kinds, after)
        for run_id, kinds, after in polls
        if any(
            (run_id, kind) in newest and (after is None or newest[run_id, kind] > after) for kind in (kinds or KINDS)
        )
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
                  WHERE c.run_id = f.run_id AND c.kind = 'rollback'
                    AND (answered.id = f.id OR (answered.step_start <= f.step_start AND f.created_at <= c.updated_at)))
"""


def rollbacks_for_anomalies(con: duckdb.DuckDBPyConnection, run_id: str, policy: RollbackPolicy) -> list[dict]:
    """A rollback for the run's firing anomaly findings that have none yet, back before the
    earliest, unless one is under way: one anomaly often shows as several findings (a loss spike
    with its gradient-norm spike), and one rollback ends them all, or, failing, answers them all."""
    if con.execute(
        "SELECT 1 FROM commands WHERE run_id = ? AND kind = 'rollback' AND state IN ('pending', 'acked')", [run_id]
    ).fetchone():
        return []
    findings = [f for f in con.execute(_UNANSWERED, [run_id, ANOMALIES]).fetchall() if f[1] in policy.on]
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


_HANGS_UNASKED = """SELECT f.id FROM findings f
                     WHERE f.run_id = ? AND f.analyzer = ? AND f.kind = ? AND f.state = 'firing'
                       AND NOT EXISTS (SELECT 1 FROM commands c WHERE c.finding_id = f.id AND c.kind = 'stacks')
                     ORDER BY f.id"""


def stacks_for_hangs(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict]:
    """A stacks request of every rank for each of the run's firing hang findings that has none yet: one per
    finding, made when it first fires (the hang analyzer's next passes read the answers)."""
    return [
        create(con, run_id, "stacks", {"ranks": None}, "analysis", finding_id)
        for (finding_id,) in con.execute(_HANGS_UNASKED, [run_id, HANGS, HANG]).fetchall()
    ]


def settle_stacks(
    con: duckdb.DuckDBPyConnection, ttl_s: float = STACKS_TTL_S, run_ids: list[str] | None = None
) -> list[dict]:
    """The stacks requests pending for `ttl_s` since their creation (of `run_ids` alone, where given: in a lake,
    the runs a collector leads), settled: `applied` where every rank asked answered, else `failed` with the
    ranks that did not (`unanswered`); each with how many answered. (The analysis's reader is imported here, in
    the writer's process: the server's, which sends this module's requests, loads none of the analysis.)"""
    from collector.analysis.engine import read_stacks

    due = con.execute(
        "SELECT id, run_id FROM commands WHERE kind = 'stacks' AND state = 'pending' AND created_at <= "
        "now() - to_microseconds($ttl) AND ($runs IS NULL OR list_contains($runs, run_id)) ORDER BY id",
        {"ttl": int(ttl_s * 1e6), "runs": run_ids},
    ).fetchall()
    settled = []
    for command_id, run_id in due:
        answers = read_stacks(con, run_id, command_id)
        merged = merge(answers) if answers is not None else {"answered": 0, "unanswered": []}
        missing = merged["unanswered"]
        result = {"answered": merged["answered"]} | ({"unanswered": missing} if missing else {})
        settled.append(update(con, command_id, "failed" if missing else "applied", result=result))
    return settled


@dataclass(frozen=True)
class Rollbacks(Consumer):
    """A rollback for a run's anomalies, by `policy` (rollbacks_for_anomalies), after each pass that judged steps."""

    policy: RollbackPolicy
    name: ClassVar[str] = "rollbacks"

    def on_pass(self, con: duckdb.DuckDBPyConnection, judged: Pass) -> None:
        if judged.new_steps:
            rollbacks_for_anomalies(con, judged.run_id, self.policy)


class StacksRequests(Consumer):
    """Every rank of a run asked for its stacks after the pass that draws a hang (stacks_for_hangs; not the last
    pass, as the collector stops), and the requests whose time is up settled on the timer's passes
    (settle_stacks)."""

    name: ClassVar[str] = "stacks requests"

    def on_pass(self, con: duckdb.DuckDBPyConnection, judged: Pass) -> None:
        if judged.found.get(HANGS) and not judged.last:
            stacks_for_hangs(con, judged.run_id)

    def on_timer(self, con: duckdb.DuckDBPyConnection, runs: Sequence[str] | None) -> None:
        settle_stacks(con, run_ids=None if runs is None else list(runs))


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
    kinds: tuple[str, ...] | None = None
    after: int | None = None


@dataclass(frozen=True)
class UpdateCommand(Request[dict]):
    """A job's report of a command's progress (update)."""

    command_id: int
    state: str
    apply_step: int | None = None
    result: dict | None = None


@dataclass(frozen=True)
class PendingPolls(Request[list[Poll]]):
    """Which of `polls` have a pending command of theirs (the control API's held polls)."""

    polls: list[Poll]


@handles(CreateCommand, passes=_REFUSALS)
def _create(context: Context, r: CreateCommand) -> dict:
    return create(context.con, r.run_id, r.kind, r.args, r.created_by)


@handles(ListCommands, passes=_REFUSALS)
def _listing(context: Context, r: ListCommands) -> list[dict]:
    return listing(context.con, r.run_id, r.state, r.kinds, r.after)


@handles(UpdateCommand, passes=_REFUSALS)
def _update(context: Context, r: UpdateCommand) -> dict:
    if r.state != "cancelled" and get(context.con, r.command_id)["kind"] == "stacks":
        raise CommandError(
            f"command {r.command_id} is a stacks request: ranks answer it with {EVENT_RANK_STACKS} events, and it "
            f"settles by itself {STACKS_TTL_S:g} s after its creation; it can only be cancelled"
        )
    return update(context.con, r.command_id, r.state, r.apply_step, r.result)


@handles(PendingPolls, beside=True)
def _pending_polls(context: Context, r: PendingPolls) -> list[Poll]:
    return pending_polls(context.con, r.polls)

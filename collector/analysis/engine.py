"""The analysis engine: each committed step of a run judged once by every analyzer of the
registry (collector/analysis/analyzers/registry.py), whatever the step rate, the same way live and after
the fact.

A cursor per run says the newest step judged. A pass takes the steps after it that every rank
has reported (a run's ranks export apart; a step half-arrived would compare a rank with some of
its peers only), at most `rank_steps` rank-steps of them (so one pass costs the same at 16,384
ranks as at 8, and a backlog is judged over several), and hands each analyzer those steps with
the history its baseline needs (`Reads.history` steps before), each new step judged as if it
were the newest. Analyzers that read only steps are not called where none came; those that
judge the passing of time (`Reads.every_pass`: a stall) are called on every pass.

The steps a pass read are kept for the next (`_History`): a run's next pass reads only the steps
that came after them, not its whole history again (at 65,536 ranks, 96 steps of history are 6.3
million rank-steps). What was kept is dropped whenever the cursor moves back or jumps, since
the steps under it may have changed.

A rollback applied to the run moves its cursor back to the restored step: the steps trained
again are judged again, as the new trajectory they are (`current_steps`). Steps that come at or
below steps already judged (told by the live collector, which sees each commit) move it back under
them too, the steps judged above them kept apart, so that one step sent far ahead does not leave
the run's own steps unjudged.
"""

import contextlib
import importlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import duckdb
import numpy as np
import pandas as pd

from collector.analysis import recorded as recorders
from collector.analysis.analyzers import Frames, Tiers
from collector.analysis.analyzers.registry import ANALYZERS
from collector.analysis.stacks import Answers
from collector.findings import COLLECTOR, Finding
from rankwatch.agent import semconv as sc

log = logging.getLogger("rankwatch.analysis")

ENDED = sc.EVENT_ENDED  # the event each rank's agent sends when its training loop ends
ENDING_WAIT_S = 30.0  # the longest a run's end waits for the last steps its ranks' `ended` events name
RANK_STEPS = 2**18  # rank-steps one pass judges at most: 16 steps of 16,384 ranks, the whole backlog of small jobs
PART_ROWS = 2**16  # the steps kept between passes are kept in parts of about as many rows as this, or a pass's

_NEWEST = """SELECT rank, max(step) FROM current_steps WHERE run_id = $run AND step > $after AND step < $before
             GROUP BY rank"""
_NTH_STEP = """SELECT DISTINCT step FROM current_steps WHERE run_id = $run AND step > $after AND step <= $upto
               ORDER BY step LIMIT 1 OFFSET $n"""
_STEPS = """SELECT rank, step, epoch_ns(end_ts) AS end_ts, duration_s, data_s, compute_s, comm_wait_s, loss,
                   grad_norm, coalesce(NOT isfinite(loss), false) OR coalesce(NOT isfinite(grad_norm), false)
                   AS non_finite
            FROM current_steps WHERE run_id = $run AND step > $after AND step <= $upto"""
_COLLECTIVES = f"""SELECT run_id, rank, step, name, comm_group, group_size, duration_s, busbw_gbps, bytes, seq,
                         attrs->>{sc.json_path(sc.COMM_ROLE)} AS role FROM ops
                  WHERE run_id = $run AND kind = 'comm' AND busbw_gbps IS NOT NULL
                    AND step > $after AND step <= $upto"""
_DEVICES = """SELECT rank, epoch_ns(ts) AS ts, metric, value FROM device_samples
              WHERE run_id = $run AND ts BETWEEN make_timestamp_ns($since) AND make_timestamp_ns($until)"""
# some metrics' samples, each series' (a rank's GPU, a port) last of each slice of time
_NODE_SAMPLES = f"""SELECT rank, max(epoch_ns(ts)) AS ts, metric, arg_max(value, ts) AS value, gpu,
                             attrs->>{sc.json_path(sc.IB_PORT)} AS port
                      FROM device_samples
                      WHERE run_id = $run AND ts BETWEEN make_timestamp_ns($since) AND make_timestamp_ns($until)
                        AND metric IN (SELECT unnest($metrics))
                      GROUP BY rank, metric, gpu, port, (epoch_ns(ts) - $since) // $slice"""
_WORKLOAD = f"""SELECT rank, step, tokens, TRY_CAST(attrs->>{sc.json_path(sc.STEP_FLOPS)} AS DOUBLE) AS flops
                FROM current_steps WHERE run_id = $run AND step > $after AND step <= $upto"""
_TIER_STEPS = f"""SELECT rank, step, epoch_ns(end_ts) AS end_ts, duration_s,
                         TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_S)} AS DOUBLE) AS transfer_s,
                         TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_EXPOSED_S)} AS DOUBLE) AS exposed_s,
                         TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_CPU_S)} AS DOUBLE) AS transfer_cpu_s,
                         TRY_CAST(attrs->>{sc.json_path(sc.HOST_OPTIMIZER_S)} AS DOUBLE) AS host_s,
                         coalesce((SELECT device = 'cpu' FROM ranks r WHERE r.run_id = $run AND r.rank = s.rank), false)
                           AS on_cpu
                  FROM current_steps s WHERE run_id = $run AND step > $after AND step <= $upto
                    AND ((attrs->>{sc.json_path(sc.TRANSFER_S)}) IS NOT NULL
                         OR (attrs->>{sc.json_path(sc.HOST_OPTIMIZER_S)}) IS NOT NULL)"""
# (a count of at most one row: EXISTS over current_steps answers false wrongly in DuckDB 2.0.1)
_SWAPPED = f"""SELECT count(*) FROM (SELECT 1 FROM current_steps WHERE run_id = $run AND step > $after AND step <= $upto
                                       AND ((attrs->>{sc.json_path(sc.TRANSFER_S)}) IS NOT NULL
                                            OR (attrs->>{sc.json_path(sc.HOST_OPTIMIZER_S)}) IS NOT NULL) LIMIT 1)"""
_TRANSFERS = f"""SELECT rank, step, attrs->>{sc.json_path(sc.TRANSFER_SRC)} AS src,
                        attrs->>{sc.json_path(sc.TRANSFER_DST)} AS dst,
                        TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_BYTES)} AS BIGINT) AS bytes,
                        duration_s AS seconds, epoch_ns(start_ts) AS start_ns, epoch_ns(end_ts) AS end_ns
                 FROM ops WHERE run_id = $run AND kind = '{sc.KIND_TRANSFER}' AND step > $after AND step <= $upto"""
_PROBES = f"""SELECT rank, TRY_CAST(attrs->>{sc.json_path(sc.DISK_PROBE_READ_BPS)} AS DOUBLE) AS read_bps,
                     TRY_CAST(attrs->>{sc.json_path(sc.DISK_PROBE_WRITE_BPS)} AS DOUBLE) AS write_bps
              FROM events WHERE run_id = $run AND event = '{sc.EVENT_DISK_PROBE}'"""
_DISK_CHECKPOINTS = f"""SELECT rank, step,
                               epoch_ns(ts) - CAST(TRY_CAST(attrs->>{sc.json_path(sc.CKPT_WRITE_S)} AS DOUBLE) * 1e9
                                                   AS BIGINT) AS start_ns,
                               epoch_ns(ts) AS end_ns
                        FROM events WHERE run_id = $run AND event = '{sc.EVENT_CHECKPOINT_SAVED}'
                          AND (attrs->>{sc.json_path(sc.CKPT_TIER)}) = '{sc.TIER_DISK}'
                          AND (attrs->>{sc.json_path(sc.CKPT_WRITE_S)}) IS NOT NULL
                          AND ts BETWEEN make_timestamp_ns($since) AND make_timestamp_ns($until)"""
_HEARTBEATS = f"""SELECT rank, epoch_ns(ts) AS ts, step, attrs->>{sc.json_path(sc.PHASE)} AS phase,
                         attrs->>{sc.json_path(sc.COMM_OP)} AS op, attrs->>{sc.json_path(sc.COMM_GROUP)} AS "group",
                         TRY_CAST(attrs->>{sc.json_path(sc.COMM_SEQ)} AS BIGINT) AS seq,
                         TRY_CAST(attrs->>{sc.json_path(sc.COMM_DONE)} AS BOOLEAN) AS done,
                         TRY_CAST(attrs->>{sc.json_path(sc.COMM_PEER)} AS BIGINT) AS peer,
                         attrs->>{sc.json_path(sc.COMM_ROLE)} AS role
                  FROM events WHERE run_id = $run AND event = 'heartbeat' AND ts > make_timestamp_ns($since)"""
_RESUMED = """SELECT CAST(result->>'restored_step' AS BIGINT), CAST(result->>'resumed_ns' AS BIGINT) FROM commands
               WHERE run_id = $run AND kind = 'rollback' AND state = 'applied'
                 AND CAST(result->>'resumed_ns' AS BIGINT) > $since"""
_ABANDONED = """SELECT max(epoch_ns(end_ts)) FROM steps WHERE run_id = $run AND step >= $restored
                  AND end_ts < make_timestamp_ns($resumed)"""
_FAILURES = f"""SELECT rank, epoch_ns(ts) AS ts, step, body, attrs->>{sc.json_path(sc.FAILURE_CAUSE)} AS cause,
                       attrs->>{sc.json_path(sc.FAILURE_EXCEPTION)} AS exception,
                       attrs->>{sc.json_path(sc.FAILURE_MESSAGE)} AS message,
                       attrs->>{sc.json_path(sc.FAILURE_SIGNAL)} AS signal,
                       TRY_CAST(attrs->>{sc.json_path(sc.FAILURE_EXIT_CODE)} AS BIGINT) AS exit_code,
                       TRY_CAST(attrs->>{sc.json_path(sc.ATTEMPT)} AS BIGINT) AS attempt
                FROM events WHERE run_id = $run AND event = '{sc.EVENT_RANK_FAILED}' AND ts > make_timestamp_ns($since)
                ORDER BY ts, rank"""
# each failed rank's newest step stored by the time it failed (a restart's steps come after), within the hour before
_LAST_STEPS = """SELECT f.rank, f.ts, max(s.step) AS last_step
                 FROM (SELECT unnest($ranks::INTEGER[]) AS rank, unnest($ts::BIGINT[]) AS ts) f
                 JOIN steps s ON s.run_id = $run AND s.rank = f.rank AND epoch_ns(s.end_ts) <= f.ts
                                 AND s.end_ts > make_timestamp_ns($since)
                 GROUP BY f.rank, f.ts"""
LAST_STEP_S = 3600  # how far before the failures read a rank's last step is looked for
# The run's newest stacks request (or the one asked for), and each rank's answer to it (its newest, should it
# answer twice), ranks whose main threads stand in the same frames together: at 16,384 ranks a few groups
# cross to Python, not the 16,384 answers (each up to 256 KiB with the Flight Recorder's entries)
_STACKS_REQUESTS = """SELECT id, state, epoch_ns(created_at), CAST(args->'ranks' AS INTEGER[]) FROM commands
                      WHERE run_id = $run AND kind = 'stacks' AND ($request IS NULL OR id = $request)
                        AND (NOT $every_rank OR coalesce(json_type(args->'ranks'), 'NULL') = 'NULL')
                        AND ($since IS NULL OR epoch_ns(created_at) >= $since)
                        AND ($until IS NULL OR epoch_ns(created_at) <= $until)
                      ORDER BY created_at DESC, id DESC LIMIT 2"""
_MAIN_THREADS = "TRY_CAST(json_extract(body, '$.threads') AS JSON[])"
_ANSWERS = f"""FROM events WHERE run_id = $run AND event = '{sc.EVENT_RANK_STACKS}' AND rank IS NOT NULL
                               AND ts >= make_timestamp_ns($since)
                               AND TRY_CAST(attrs->>{sc.json_path(sc.STACKS_REQUEST)} AS BIGINT) = $request"""
_STACKS = f"""SELECT frames, list(rank ORDER BY rank), read_by FROM (
                SELECT rank, CASE WHEN json_valid(body) THEN coalesce(
                                list_filter({_MAIN_THREADS}, lambda t: TRY_CAST(t->>'main' AS BOOLEAN))[1],
                                list_filter({_MAIN_THREADS}, lambda t: t->>'name' = 'MainThread')[1]) -> 'frames'
                             END AS frames,
                             CASE WHEN json_valid(body) THEN body->>'read_by' END AS read_by
                FROM (SELECT rank, arg_max(body, ts) AS body {_ANSWERS} GROUP BY rank))
              GROUP BY frames, read_by"""
# What answers a request has, without reading their bodies: a hang's every pass reads them again only when it changed
_ANSWERED = f"SELECT count(*), max(epoch_ns(ts)) {_ANSWERS}"
# Each rank's Flight Recorder in its answer, of the ranks whose answers were not read before
_RECORDERS = f"""SELECT rank, CASE WHEN json_valid(body) THEN json_extract(body, '$.flight_recorder') END
                 FROM (SELECT rank, arg_max(body, ts) AS body {_ANSWERS}
                         AND NOT list_contains($read::INTEGER[], rank) GROUP BY rank)"""
_RANKS_OF_RUN = """SELECT (SELECT list(rank) FROM ranks WHERE run_id = $run),
                          (SELECT max(world_size) FROM runs WHERE run_id = $run)"""
STACKS_CLOCK_S = 600  # how long before its request an answer may be dated (a rank's clock against the collector's)
_FAILED_ROLLBACKS = """SELECT run_id, id, finding_id, result FROM commands
                       WHERE run_id = $run AND kind = 'rollback' AND state = 'failed'"""
_APPLIED_ROLLBACKS = """SELECT id, CAST(result->>'restored_step' AS BIGINT) FROM commands
                        WHERE run_id = $run AND kind = 'rollback' AND state = 'applied' AND id > $seen ORDER BY id"""
# the ranks that said they ended, when the last did, and how many of them named a last step not yet stored
_ENDED = """WITH ended AS (SELECT rank, ts, step FROM events WHERE run_id = $run AND event = $ended),
                 newest AS (SELECT rank, max(step) AS step FROM current_steps
                            WHERE run_id = $run AND step >= (SELECT min(step) FROM ended) GROUP BY rank)
            SELECT count(DISTINCT e.rank), max(epoch_ns(e.ts)), count(*) FILTER (WHERE e.step > coalesce(n.step, -1))
            FROM ended e LEFT JOIN newest n ON n.rank = e.rank"""
_WORLD = """SELECT greatest((SELECT count(*) FROM ranks WHERE run_id = $1),
                            (SELECT coalesce(max(world_size), 0) FROM runs WHERE run_id = $1))"""
_FIRST_OF_NEW_RANKS = """SELECT min(step) FROM current_steps WHERE run_id = ? AND step <= ? AND rank IN
                         (SELECT rank FROM ranks WHERE run_id = ? ORDER BY first_seen DESC LIMIT ?)"""
_PLACEMENT = "SELECT rank, host, dp_rank, pp_stage, tp_rank FROM ranks WHERE run_id = ?"
_FIRST_JUDGED_AFTER = """SELECT min(step) FROM current_steps WHERE run_id = $run AND step > $after
                          AND (step <= $cursor OR step BETWEEN $ahead AND $top)"""
# (counts of at most one row: EXISTS over current_steps answers false wrongly in DuckDB 2.0.1)
_PAST_AHEAD = """SELECT (SELECT count(*) FROM (SELECT 1 FROM current_steps
                                         WHERE run_id = $run AND step > $after AND step < $ahead LIMIT 1)),
                        (SELECT count(*) FROM (SELECT 1 FROM current_steps
                                               WHERE run_id = $run AND step > $top LIMIT 1))"""
STEPS_END = 2**40  # steps are in [0, STEPS_END): what ingest takes (collector/receive/decode.py)
# Ranges of steps committed for a run and not yet judged, kept apart: a commit brings one a rank (its
# batch), so a few; a client that scatters its steps gets the nearest merged, a few old steps judged again.
MAX_LATE_RANGES = 64
HEARTBEATS_S = 120  # heartbeats read back from the moment judged: a stall's culprits are in the last few


def add_steps(ranges: Sequence[tuple[int, int]], new: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges of steps (each from its first step to its last), sorted, with `new` added: those that
    overlap or touch merged, and at most MAX_LATE_RANGES kept (beyond, the two nearest merge, and
    the steps between them, judged before, are judged again)."""
    merged: list[list[int]] = []
    for low, high in sorted([*ranges, *new]):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    while len(merged) > MAX_LATE_RANGES:
        i = min(range(len(merged) - 1), key=lambda i: merged[i + 1][0] - merged[i][1])
        merged[i : i + 2] = [[merged[i][0], merged[i + 1][1]]]
    return [(low, high) for low, high in merged]


@dataclass
class Cursor:
    step: int = -1  # the newest step judged (steps are never negative)
    rollback: int = 0  # the newest applied rollback command seen
    world: int = 0  # the ranks known when it last judged
    ended_ns: int | None = None  # when every rank said it ended, once known
    ending: bool = False  # every rank said it ended, but not every rank's last step is stored yet
    # Steps judged ahead of the cursor, from `ahead` to `top` (kept in memory only): steps that came
    # below steps already judged (a step sent far ahead of the run, a job restarted from a checkpoint)
    # moved the cursor back under them; the cursor goes on below `ahead`, and past `top` once the run
    # has stepped past it, without judging again what was judged there.
    ahead: int | None = None
    top: int | None = None
    late: list[tuple[int, int]] = field(default_factory=list)  # steps committed at or below `top`, not yet judged


@dataclass
class _History:
    """The steps a run's last pass read, for its next: every rank-step after `after` up to `upto`
    (deduplicated and sorted as Frames.steps, in parts), at most the longest history any analyzer reads; and
    what the analyzers derived from them (Frames.kept), which goes with them."""

    after: int
    upto: int
    parts: list[pd.DataFrame]  # sorted by step, each a pass's (those of small passes put together)
    derived: dict[str, dict] = field(default_factory=dict)


@dataclass
class Judged:
    """One pass over one run: the steps judged (`first_new` to `last`; none where first > last),
    each analyzer's findings, whether steps are left for another pass (`more`) or wait for some
    rank (`behind`), and whether the run has ended with all its steps judged. `rolled_back`: the
    step a rollback restored, where one moved the cursor back."""

    run_id: str
    first_new: int
    last: int
    found: dict[str, list[Finding]] = field(default_factory=dict)
    more: bool = False
    ended: bool = False
    rolled_back: int | None = None
    behind: bool = False  # steps were reported after `last` that not every rank has yet
    failed: list[str] = field(default_factory=list)  # the analyzers that raised: none of their findings
    idle: bool = False  # nothing new to judge, and the pass did not ask for time's judgement alone: not judged


class Engine:
    """The runner: cursors and passes. `settings`: an analyzer's settings by its name (its defaults
    where none is given)."""

    def __init__(
        self,
        settings: Mapping[str, object] | None = None,
        analyzers=ANALYZERS,
        rank_steps: int = RANK_STEPS,
        stored: bool = False,
    ):
        """`stored`: a run's cursor starts where the store's `analysis_cursors` says (the live
        collector, which records it with each pass's findings); else from the run's first step."""
        self.stored = stored
        self.settings = dict(settings or {})
        self._modules = tuple(a.__name__ for a in analyzers)  # by name: an Engine is pickled to the writer
        self.reads = {a.ANALYZER: a.READS for a in analyzers}
        self.rank_steps = rank_steps
        self.cursors: dict[str, Cursor] = {}
        self._history: dict[str, _History] = {}
        self._stacks_read: dict[str, dict] = {}  # run -> the answers its stacks requests had, by what had come
        self._longest = max((a.READS.history for a in analyzers), default=0)  # the most steps any reads back

    def __getstate__(self) -> dict:
        """What is pickled to the writer process: settings and cursors, not the steps kept in memory."""
        return {**self.__dict__, "_history": {}, "_stacks_read": {}}

    def release(self, run_id: str) -> None:
        """Drop the steps kept for a run (one that went quiet: memory is for the runs that step); its
        next pass reads them again."""
        self._history.pop(run_id, None)
        self._stacks_read.pop(run_id, None)

    def forget(self, run_id: str) -> None:
        """Drop a run's cursor (a pass that failed to record: the next starts from the stored one)."""
        self.cursors.pop(run_id, None)
        self.release(run_id)

    @property
    def analyzers(self) -> tuple:
        return tuple(importlib.import_module(name) for name in self._modules)

    def judge(
        self,
        con: duckdb.DuckDBPyConnection,
        run_id: str,
        now_ns: int,
        final: bool = False,
        ended_came: bool = True,
        arrived: Sequence[tuple[int, int]] = (),
        timed: bool = True,
    ) -> Judged:
        """The next pass over `run_id`, its cursor moved past what it judged. `final`: the steps not
        every rank has reported are judged too (nothing more will come). `ended_came`: ranks'
        ends (`ended` events, or `rank_failed`) may have come since the last pass (the live collector
        knows when any did); `ended` events are looked for then, on a run's first pass, and while it is
        ended (steps after its end undo it).
        `arrived`: the steps of the rows committed for the run since its last pass, as ranges (the
        live collector knows; after the fact nothing is known), so that steps arriving below steps
        already judged are judged too. `timed`: the pass also judges what the passing of time alone
        changes (a stall); a pass woken by a commit (False) judges the run only where there is a step
        every rank has reported, an end, a rollback or steps under those judged (most commits of a
        job bring some ranks' steps alone), and is `idle` otherwise, at the cost of a few reads."""
        new = run_id not in self.cursors
        if new and self.stored:
            row = con.execute(
                "SELECT step, rollback, world FROM analysis_cursors WHERE run_id = ?", [run_id]
            ).fetchone()
            self.cursors[run_id] = Cursor(*row) if row else Cursor()
        cursor = self.cursors.setdefault(run_id, Cursor())
        judged_to = cursor.step
        rolled_back = self._rewind_to_rollbacks(con, run_id, cursor)
        if ended_came or final or new or cursor.ended_ns is not None or cursor.ending:
            cursor.ended_ns, cursor.ending = self._ended(con, run_id, now_ns, final)
        world = con.execute(_WORLD, [run_id]).fetchall()[0][0]
        self._rewind_to_new_ranks(con, run_id, cursor, world)
        cursor.late = add_steps(cursor.late, arrived)
        self._rewind_under_late_steps(con, run_id, cursor)
        self._skip_judged_ahead(con, run_id, cursor)
        if cursor.step != judged_to:  # steps at or under those read may have changed (a rollback, late steps)
            self.release(run_id)
        before = STEPS_END if cursor.ahead is None else cursor.ahead
        newest = dict(con.execute(_NEWEST, {"run": run_id, "after": cursor.step, "before": before}).fetchall())
        world = max(world, len(newest))
        if final or cursor.ended_ns is not None:
            upto = max(newest.values(), default=cursor.step)
        else:
            upto = min(newest.values()) if newest and len(newest) >= world else cursor.step
        last, more = upto, False
        budget = max(self.rank_steps // max(world, 1), 1)
        if upto - cursor.step > budget:
            nth = con.execute(
                _NTH_STEP, {"run": run_id, "after": cursor.step, "upto": upto, "n": budget - 1}
            ).fetchone()
            if nth is not None and nth[0] < upto:
                last, more = int(nth[0]), True
        first_new = cursor.step + 1
        moved = cursor.step != judged_to or rolled_back is not None or bool(cursor.late)
        ending = ended_came or cursor.ended_ns is not None or cursor.ending
        behind = max(newest.values(), default=last) > last
        if not (timed or final or new or moved or ending) and last < first_new:
            return Judged(run_id, first_new, last, behind=behind, idle=True)
        frames = self._frames(con, run_id, first_new, last, now_ns, cursor.ended_ns)
        judged = Judged(
            run_id,
            first_new,
            last,
            more=more or bool(cursor.late),
            rolled_back=rolled_back,
            behind=behind,
        )
        if frames is not None:
            for analyzer in self.analyzers:
                reads = analyzer.READS
                if last >= first_new or reads.every_pass:
                    settings = self.settings.get(analyzer.ANALYZER)
                    with _isolated(judged, analyzer.ANALYZER):
                        judged.found[analyzer.ANALYZER] = analyzer.judge(frames, *([settings] if settings else []))
            for analyzer in self.analyzers:  # those that speak to the others' findings, once all judged
                settings = self.settings.get(analyzer.ANALYZER)
                if hasattr(analyzer, "revise") and settings and analyzer.ANALYZER not in judged.failed:
                    with _isolated(judged, analyzer.ANALYZER):
                        judged.found = analyzer.revise(judged.found, frames, settings)
        cursor.step, cursor.world = last, world
        judged.more |= self._skip_judged_ahead(con, run_id, cursor)  # the steps past those judged ahead: next
        judged.ended = cursor.ended_ns is not None and not judged.more
        if judged.ended:  # judged to its end: nothing more to read
            self.release(run_id)
        return judged

    def _rewind_to_new_ranks(self, con: duckdb.DuckDBPyConnection, run_id: str, cursor: Cursor, world: int) -> None:
        """Ranks first heard from after steps were judged without them (a job whose world size is
        not said, its ranks' first exports apart): the cursor moves back to their first step."""
        if world <= cursor.world or cursor.step < 0:
            return
        (first,) = con.execute(_FIRST_OF_NEW_RANKS, [run_id, cursor.step, run_id, world - cursor.world]).fetchall()[0]
        if first is not None:
            cursor.step = int(first) - 1

    def _rewind_under_late_steps(self, con: duckdb.DuckDBPyConnection, run_id: str, cursor: Cursor) -> None:
        """Steps that came at or below steps already judged (a rank's steps went back: a step sent far
        ahead of the run, then the run's own; a job started again from a checkpoint; a batch sent
        again after later ones): the cursor moves back under the lowest range of them (the others
        wait for the passes that follow at once), and the steps judged above it (`ahead` to `top`)
        are not judged again. So the cursor follows the steps judged, never the largest step seen:
        one step at 2^40 - 1 leaves the steps after it judged as they come."""
        top = cursor.step if cursor.top is None else max(cursor.step, cursor.top)
        cursor.late = [(low, high) for low, high in cursor.late if low <= top]  # the others are new steps
        if not cursor.late:
            return
        (low, high), cursor.late = cursor.late[0], cursor.late[1:]
        judged = {"cursor": cursor.step, "ahead": cursor.ahead, "top": cursor.top}
        if cursor.ahead is None:
            judged.update(ahead=STEPS_END, top=-1)
        (ahead,) = con.execute(_FIRST_JUDGED_AFTER, {"run": run_id, "after": high, **judged}).fetchall()[0]
        cursor.step = min(cursor.step, low - 1)
        cursor.ahead, cursor.top = (None, None) if ahead is None else (int(ahead), top)

    def _skip_judged_ahead(self, con: duckdb.DuckDBPyConnection, run_id: str, cursor: Cursor) -> bool:
        """Once every step below those judged ahead is judged and the run has stepped past them, the
        cursor goes on from the newest of them; whether it did."""
        if cursor.ahead is None or cursor.top is None:
            return False
        below, past = con.execute(
            _PAST_AHEAD, {"run": run_id, "after": cursor.step, "ahead": cursor.ahead, "top": cursor.top}
        ).fetchall()[0]
        if below or not past:
            return False
        cursor.step, cursor.ahead, cursor.top = cursor.top, None, None
        return True

    def _rewind_to_rollbacks(self, con: duckdb.DuckDBPyConnection, run_id: str, cursor: Cursor) -> int | None:
        """The cursor moved back to before the earliest step a rollback applied since the last pass
        restored (the steps from there are trained again); that step, or None."""
        applied = con.execute(_APPLIED_ROLLBACKS, {"run": run_id, "seen": cursor.rollback}).fetchall()
        if not applied:
            return None
        cursor.rollback = int(applied[-1][0])
        restored = min((int(step) for _, step in applied if step is not None), default=None)
        if restored is None or restored > cursor.step:
            return None
        cursor.step = restored - 1
        return restored

    def _ended(self, con: duckdb.DuckDBPyConnection, run_id: str, now_ns: int, final: bool) -> tuple[int | None, bool]:
        """When every rank said its training loop ended, where all did (a rank that started again
        after its end sends steps after it: the run goes on); and whether the run is ending: a rank's
        `ended` names its last step, which its agent may send after it, so the run ends once every
        rank's last step is stored, or ENDING_WAIT_S after the last `ended` (those steps were lost;
        after the fact, `final`, nothing more will come)."""
        ranks, at, waiting = con.execute(_ENDED, {"run": run_id, "ended": ENDED}).fetchall()[0]
        if not ranks or ranks < con.execute(_WORLD, [run_id]).fetchall()[0][0]:
            return None, False
        later = con.execute(
            "SELECT count(*) FROM (SELECT 1 FROM steps WHERE run_id = ? AND end_ts > make_timestamp_ns(?) LIMIT 1)",
            [run_id, int(at)],
        ).fetchall()[0][0]
        if later:
            return None, False
        if waiting and not final and (now_ns - at) / 1e9 < ENDING_WAIT_S:
            return None, True
        return int(at), False

    def _frames(
        self, con: duckdb.DuckDBPyConnection, run_id: str, first_new: int, last: int, now_ns: int, ended_ns: int | None
    ) -> Frames | None:
        """What the analyzers read, once for all of them; None for a run without steps."""
        upto = max(last, first_new - 1)
        reads = [a.READS for a in self.analyzers if a.READS.every_pass or last >= first_new]  # those called
        history = max((r.history for r in reads), default=0)
        steps = [p for p in self._steps(con, run_id, first_new - 1 - max(history, 1), upto) if not p.empty]
        if not steps:
            return None
        stated = con.execute("SELECT max(world_size) FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0]
        frames = Frames(
            run_id,
            steps,
            first_new,
            upto,
            con.execute(_PLACEMENT, [run_id]).df(),
            now_ns,
            ended_ns,
            stated,
            kept=self._history[run_id].derived,
        )
        if any(r.collectives for r in reads):
            history = max(r.history for r in reads if r.collectives)
            frames.collectives = con.execute(
                _COLLECTIVES, {"run": run_id, "after": first_new - 1 - history, "upto": upto}
            ).df()
        if any(r.heartbeats for r in reads):
            since = min(now_ns, min(int(p["end_ts"].min()) for p in steps)) - HEARTBEATS_S * 10**9
            frames.heartbeats = con.execute(_HEARTBEATS, {"run": run_id, "since": since}).df()
            frames.resumed = _resumed(con, run_id, since)
        if any(r.failed_rollbacks for r in reads):
            failed = con.execute(_FAILED_ROLLBACKS, {"run": run_id}).df()
            failed["result"] = failed["result"].map(lambda r: json.loads(r) if r else None)
            frames.failed_rollbacks = failed
        if any(r.failures for r in reads):  # those since a little before the steps read (a long run's events are many)
            since = min(now_ns, min(int(p["end_ts"].min()) for p in steps)) - HEARTBEATS_S * 10**9
            frames.failures = _failures(con, run_id, since)
        if any(r.workload for r in reads):
            history = max(r.history for r in reads if r.workload)
            after = first_new - 1 - history
            frames.workload = lambda: con.execute(_WORKLOAD, {"run": run_id, "after": after, "upto": upto}).df()
        if any(r.tiers for r in reads):
            history = max(r.history for r in reads if r.tiers)
            frames.tiers = lambda: _tiers(con, run_id, first_new, first_new - 1 - history, upto)
        if any(r.stacks for r in reads):
            known = self._stacks_read.setdefault(run_id, {})
            frames.stacks = lambda since, until: read_stacks(
                con, run_id, every_rank=True, made=(since, until), known=known, recorded=True
            )
        if any(r.devices for r in reads):
            frames.devices = lambda since, until: con.execute(
                _DEVICES, {"run": run_id, "since": since, "until": until}
            ).df()
        if any(r.node_samples for r in reads):
            frames.node_samples = lambda since, until, slice_ns, metrics: con.execute(
                _NODE_SAMPLES,
                {"run": run_id, "since": since, "until": until, "slice": slice_ns, "metrics": list(metrics)},
            ).df()
        return frames

    def _steps(self, con: duckdb.DuckDBPyConnection, run_id: str, after: int, upto: int) -> list[pd.DataFrame]:
        """The run's rank-steps after `after` up to `upto` (Frames.steps), in parts by step: those the
        last pass read, where it read back far enough, and the store's after them; the longest history
        any analyzer reads is kept for the next pass. (Kept steps are never stale: the cursor moving
        back, the one way the steps under it change, drops them.)"""
        kept = self._history.get(run_id)
        start = after
        if kept is not None and kept.after <= after and kept.upto <= upto and kept.upto + 1 >= after:
            start = kept.upto
        fresh = con.execute(_STEPS, {"run": run_id, "after": start, "upto": upto}).df()
        # a step trained again after a rollback not yet applied: its newest rows are the trajectory's
        fresh = fresh.sort_values("end_ts").drop_duplicates(["rank", "step"], keep="last")
        fresh = fresh.sort_values(["step", "rank"], ignore_index=True)
        fresh.insert(0, "run_id", pd.Categorical.from_codes(np.zeros(len(fresh), np.int8), [run_id]))  # one string
        parts = _after(kept.parts, after) if start != after and kept is not None else []
        if parts and len(parts[-1]) + len(fresh) <= PART_ROWS:  # small steps go on in one part
            parts[-1] = pd.concat([parts[-1], fresh], ignore_index=True)
        elif not fresh.empty or not parts:
            parts.append(fresh)
        keep_after = max(after, upto - max(self._longest, 1))
        derived = kept.derived if start != after and kept is not None else {}
        self._history[run_id] = _History(keep_after, upto, _after(parts, keep_after), derived)
        return parts


def _resumed(con: duckdb.DuckDBPyConnection, run_id: str, since: int) -> np.ndarray:
    """Frames.resumed: for each rollback applied after `since`, the end of the last step it abandoned
    and when training resumed (the steps it abandoned are read only where one was)."""
    marks = []
    for restored, resumed in con.execute(_RESUMED, {"run": run_id, "since": since}).fetchall():
        if restored is None or resumed is None:
            continue
        abandoned = con.execute(_ABANDONED, {"run": run_id, "restored": restored, "resumed": resumed}).fetchall()[0][0]
        marks += [resumed] if abandoned is None else [abandoned, resumed]
    return np.sort(np.array(marks, np.int64))


def read_stacks(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    request: int | None = None,
    every_rank: bool = False,
    made: tuple[int | None, int | None] = (None, None),
    known: dict | None = None,
    recorded: bool = False,
) -> Answers | None:
    """The answers to the run's newest stacks request, or to `request` (the query API's and `rankwatch
    stacks`'); None where the run has no such request. `every_rank` and `made` (Frames.stacks: where a hung
    job's ranks were during a stall): the newest that asked every rank, made between `made`'s two moments
    (ns; None: no bound), or the one before it while the newest has no answer yet, so that a request for a
    few ranks, or one just made, does not take the whole picture away. `known`: the answers read before, kept
    there for the next call, read again only where more came (16,384 answers of 128 KiB are 2 GiB of JSON).
    `recorded`: with the Flight Recorder entries the answers hold (Answers.recorded), each answer's read once
    where `known` keeps them."""
    since, until = made
    asked = {"run": run_id, "request": request, "every_rank": every_rank, "since": since, "until": until}
    found = con.execute(_STACKS_REQUESTS, asked).fetchall()
    if not found:
        return None

    def answers_to(row: tuple) -> Answers:
        request_id, state, created_ns, ranks = row
        return _answers(con, run_id, request_id, state, created_ns, ranks, known, recorded)

    newest = answers_to(found[0])
    if every_rank and not newest.stacks and len(found) > 1:
        before = answers_to(found[1])
        return before if before.stacks else newest
    return newest


def _answers(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    request_id: int,
    state: str,
    created_ns: int,
    asked: list | None,
    known: dict | None = None,
    recorded: bool = False,
) -> Answers:
    """The answers to one stacks request; the ranks asked, those it names, else every rank of the run. `known`,
    `recorded`: see read_stacks (the two newest requests' answers kept)."""
    if asked is None:
        ranks, world = con.execute(_RANKS_OF_RUN, {"run": run_id}).fetchall()[0]
        asked = sorted(set(ranks or ()) | set(range(world or 0)))
    params = {"run": run_id, "request": int(request_id), "since": int(created_ns) - STACKS_CLOCK_S * 10**9}
    if known is not None:
        key = (int(request_id), *con.execute(_ANSWERED, params).fetchall()[0])
        if key in known:
            return replace(known[key], state=state, asked=asked)
    rows = con.execute(_STACKS, params).fetchall()
    stacks = [(r, _json(frames), by) for frames, r, by in rows]
    answers = Answers(int(request_id), state, int(created_ns), asked, stacks)
    if recorded:  # the answers that came since those read before (the newest that were), added to them
        before = next((a.recorded for a in reversed((known or {}).values()) if a.request == answers.request), None)
        read = {**params, "read": list(before.seen if before else ())}
        answers = replace(answers, recorded=recorders.read(run_id, _rows(con.execute(_RECORDERS, read)), before))
    if known is not None:
        for stale in [k for k in known if k[0] == key[0]]:
            del known[stale]  # the request's answers as read before: these hold them
        for stale in list(known)[:-1]:
            del known[stale]  # all but the newest other request's
        known[key] = answers
    return answers


def _rows(result: duckdb.DuckDBPyConnection, batch: int = 256) -> Iterator[tuple]:
    """A query's rows, a batch at a time (256 answers' Flight Recorders are tens of MB of JSON)."""
    while rows := result.fetchmany(batch):
        yield from rows


def _json(text: str | None) -> object:
    """A JSON value as stored (None for none, or for what does not parse: the stacks merge reads it as no frames)."""
    try:
        return None if text is None else json.loads(text)
    except (ValueError, RecursionError):
        return None


def _failures(con: duckdb.DuckDBPyConnection, run_id: str, since: int) -> pd.DataFrame:
    """Frames.failures: the run's `rank_failed` events after `since`, each with its rank's newest step stored by
    then (the steps are read only where a rank failed)."""
    failed = con.execute(_FAILURES, {"run": run_id, "since": since}).df()
    if failed.empty:
        return failed.assign(last_step=pd.Series(dtype="Int64"))
    ranks, ts = failed["rank"].tolist(), failed["ts"].tolist()
    last = con.execute(
        _LAST_STEPS, {"run": run_id, "ranks": ranks, "ts": ts, "since": since - LAST_STEP_S * 10**9}
    ).df()
    return failed.merge(last, on=["rank", "ts"], how="left")


def _tiers(con: duckdb.DuckDBPyConnection, run_id: str, first_new: int, after: int, upto: int) -> Tiers:
    """What moved between memory tiers in the run's steps after `after` up to `upto` (Frames.tiers); nothing
    where the new steps (from `first_new`) moved nothing: a run that swaps nothing costs one look at them."""
    empty = pd.DataFrame()
    if not con.execute(_SWAPPED, {"run": run_id, "after": first_new - 1, "upto": upto}).fetchall()[0][0]:
        return Tiers(empty, empty, empty, empty)
    span = {"run": run_id, "after": after, "upto": upto}
    steps = con.execute(_TIER_STEPS, span).df()
    since, until = int(steps["end_ts"].min() - steps["duration_s"].max() * 1e9), int(steps["end_ts"].max())
    return Tiers(
        steps,
        con.execute(_TRANSFERS, span).df(),
        con.execute(_PROBES, {"run": run_id}).df(),
        con.execute(_DISK_CHECKPOINTS, {"run": run_id, "since": since - 600 * 10**9, "until": until}).df(),
    )


@contextlib.contextmanager
def _isolated(judged: Judged, analyzer: str) -> Iterator[None]:
    """An analyzer that raises loses its findings of the pass, not the others' nor the pass: its
    steps are judged once, the cursor moves on, and the failure is logged and kept in `judged.failed`
    (were the pass to fail, it would judge the same steps again, and fail again, at every pass)."""
    try:
        yield
    except Exception:
        log.exception(
            "the %s analyzer failed on steps %d-%d of run %s", analyzer, judged.first_new, judged.last, judged.run_id
        )
        judged.failed.append(analyzer)


def _after(parts: list[pd.DataFrame], step: int) -> list[pd.DataFrame]:
    """The rows after `step` of parts sorted by step (a part cut by position: no rows copied)."""
    kept = [p for p in parts if len(p) and p["step"].iat[-1] > step]
    if kept and kept[0]["step"].iat[0] <= step:
        kept[0] = kept[0].iloc[int(np.searchsorted(kept[0]["step"].to_numpy(), step, side="right")) :]
    return kept


def replay(
    con: duckdb.DuckDBPyConnection, run_id: str, settings: Mapping[str, object] | None = None, now_ns: int | None = None
) -> list[Finding]:
    """Every finding of a run's history, as the live collector draws them pass by pass: the same
    engine from the first step to the last, its episodes kept in memory; each finding's span is
    its episode's. `now_ns`: the moment judged (default: when the run was last heard from)."""
    engine = Engine(settings)
    if now_ns is None:
        now_ns = _last_heard(con, run_id)
    episodes: list[tuple[str, Finding, bool]] = []  # (analyzer, finding, still firing)
    failed: dict[str, list[int]] = {}
    while True:
        judged = engine.judge(con, run_id, now_ns, final=True)
        episodes = merge(episodes, judged.found, engine.reads, judged.last)
        failures = failing(failed, judged)
        if not judged.more:
            return [f for _, f, _ in episodes] + failures


def failing(failed: dict[str, list[int]], judged: Judged) -> list[Finding]:
    """A run's `analysis_failing` findings (analyzer "collector"), one per analyzer that raised on it:
    which, over which steps (its findings there are missing), in how many passes. `failed` holds, by
    analyzer, [first step, last step, passes] over the run's passes so far; `judged`'s are added."""
    for analyzer in judged.failed:
        first, last, passes = failed.get(analyzer, [judged.first_new, judged.last, 0])
        failed[analyzer] = [min(first, judged.first_new), max(last, judged.last), passes + 1]
    return [
        Finding(
            judged.run_id,
            "analysis_failing",
            [],
            first,
            last,
            "warning",
            float(passes),
            f"the {analyzer} analyzer failed on steps {first}–{last}: its findings there are missing "
            "(the log says why)",
            {"analyzer": analyzer, "failures": passes},
            analyzer=COLLECTOR,
        )
        for analyzer, (first, last, passes) in sorted(failed.items())
    ]


def merge(
    episodes: list[tuple[str, Finding, bool]], found: Mapping[str, list[Finding]], reads: Mapping, last: int
) -> list[tuple[str, Finding, bool]]:
    """The episodes after a pass: a finding going on a firing episode of its analyzer, kind and
    ranks extends it (the strongest finding speaks for it, since the earliest onset); others start
    episodes; episodes of analyzers that judged stop firing where `Reads.holds` says so. The live
    store does the same with rows (collector/analysis/findings.py)."""
    episodes = list(episodes)
    for analyzer, drawn in found.items():
        rules = reads[analyzer]
        redrawn = set()
        for f in sorted(drawn, key=lambda f: (f.step_start is None, f.step_start or 0)):
            at = next(
                (
                    i
                    for i, (a, e, firing) in enumerate(episodes)
                    if firing and a == analyzer and (e.kind, e.ranks) == (f.kind, f.ranks)
                ),
                None,
            )
            if at is not None and rules.continues(episodes[at][1].step_end, f):
                earlier = episodes[at][1]
                # an episode that goes on (continues()) is of findings over steps
                assert f.step_start is not None and f.step_end is not None
                assert earlier.step_start is not None and earlier.step_end is not None
                f = (f if f.score >= earlier.score else earlier).spanning(
                    min(earlier.step_start, f.step_start), max(earlier.step_end, f.step_end)
                )
                episodes[at] = (analyzer, f, True)
            else:
                if at is not None:
                    episodes[at] = (analyzer, episodes[at][1], False)
                at = len(episodes)
                episodes.append((analyzer, f, True))
            redrawn.add(at)
        episodes = [
            (a, e, firing and (a != analyzer or rules.holds(e.step_end, last, i in redrawn)))
            for i, (a, e, firing) in enumerate(episodes)
        ]
    return episodes


def _last_heard(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """When a run was last heard from: its newest step or event."""
    steps, events = con.execute(
        "SELECT (SELECT max(epoch_ns(end_ts)) FROM steps WHERE run_id = $run), "
        "(SELECT max(epoch_ns(ts)) FROM events WHERE run_id = $run)",
        {"run": run_id},
    ).fetchall()[0]
    return int(max(v for v in (steps, events, 0) if v is not None))

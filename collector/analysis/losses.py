"""Telemetry loss per run, as the collector sees it and as the ranks report it.

Seen: the rank-steps expected but never received (analyzers/gaps.py), judged window by window as
a run's steps settle and kept in `telemetry_loss`, so that /metrics and the dashboard read one
row per run. A step settles once the run has moved MARGIN_STEPS steps and MARGIN_S seconds past
it (a rank's spans leave its agent in batches, so the newest steps of some ranks are still on the
way), or once the run has ended (or the collector stops: nothing more comes); a pass settles at
most RANK_STEPS rank-steps, so it costs the same at 16,384 ranks as at 8. Rank-steps that arrive
after they settled missing (an agent's backlog sent once its collector is back, a simulated fleet
whose clock runs ahead of its sending) are taken off again by the next pass: each pass counts what
came within the kept gaps and draws those gaps anew (the rank-steps counted in `left_out`, past
the blocks kept, stay counted). Reported: what each
rank's agent dropped before export (`telemetry_loss` events, cumulative per rank: the run's is the
sum of each rank's largest), read by the same passes from where the last stopped, so that a
scrape of /metrics reads one row per run, never the events.
"""

import json
from dataclasses import dataclass, field

import duckdb
import numpy as np

from collector.analysis.analyzers import gaps
from collector.analysis.engine import RANK_STEPS  # rank-steps a window holds at most, as a pass of the engine
from collector.telemetryloss import NOT_SETTLED, Gaps, Loss
from rankwatch.agent import semconv as sc

MARGIN_STEPS = 10
MARGIN_S = 10.0

_NEWEST = "SELECT max(step), max(epoch_ns(end_ts)) FROM steps WHERE run_id = $run AND step > $after"
_SETTLED = """SELECT max(step) FROM steps WHERE run_id = $run AND step > $after AND step <= $upto
              AND end_ts <= make_timestamp_ns($until)"""
_NTH_STEP = """SELECT DISTINCT step FROM steps WHERE run_id = $run AND step > $after AND step <= $upto
               ORDER BY step LIMIT 1 OFFSET $n"""
# the ranks expected: those seen, and every rank of the job's world size where its ranks said it (a rank
# whose telemetry never arrived at all is silent too)
_EXPECTED = """(SELECT rank FROM ranks WHERE run_id = $run
  UNION SELECT range::INTEGER FROM range((SELECT coalesce(max(world_size), 0) FROM runs WHERE run_id = $run)))"""
_RANKS = f"SELECT count(*) FROM {_EXPECTED}"
_STEPS = "SELECT DISTINCT step FROM steps WHERE run_id = $run AND step > $after AND step <= $upto ORDER BY step"
# each expected rank at each step some rank reported, that it did not report
_MISSING = f"""
WITH present AS (SELECT DISTINCT rank, step FROM steps WHERE run_id = $run AND step > $after AND step <= $upto)
SELECT r.rank, s.step FROM {_EXPECTED} r
CROSS JOIN (SELECT DISTINCT step FROM present) s
ANTI JOIN present p ON p.rank = r.rank AND p.step = s.step"""
# rank-steps now present within each kept gap (b: its index among the blocks)
_ARRIVED = """
WITH b AS (SELECT unnest($r0) AS r0, unnest($r1) AS r1, unnest($s0) AS s0, unnest($s1) AS s1,
                  generate_subscripts($r0, 1) AS b)
SELECT b.b, count(DISTINCT (s.rank, s.step)) FROM b JOIN steps s ON s.run_id = $run
  AND s.rank BETWEEN b.r0 AND b.r1 AND s.step BETWEEN b.s0 AND b.s1 GROUP BY b.b"""
# within one gap's ranks and steps: the steps some rank reported, and each rank-step still missing at them
_STEPS_WITHIN = "SELECT DISTINCT step FROM steps WHERE run_id = $run AND step BETWEEN $s0 AND $s1 ORDER BY step"
_STILL_MISSING = """
WITH present AS (SELECT DISTINCT rank, step FROM steps WHERE run_id = $run AND step BETWEEN $s0 AND $s1)
SELECT r.range AS rank, s.step FROM range($r0, $r1 + 1) r CROSS JOIN (SELECT DISTINCT step FROM present) s
ANTI JOIN present p ON p.rank = r.range AND p.step = s.step"""
_STORED = """SELECT settled_step, ranks, expected, missing, gaps, gaps_left_out, agent_ranks, agent_seen_ns
              FROM telemetry_loss WHERE run_id = ?"""
_RECORD = "INSERT OR REPLACE INTO telemetry_loss VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, now())"
# what a run's ranks' agents said they dropped, each rank's largest counts (they are cumulative), from `since`
_REPORTS = f"""
SELECT rank, max(TRY_CAST(attrs->>{sc.json_path(sc.SPANS_DROPPED)} AS BIGINT)),
       max(TRY_CAST(attrs->>{sc.json_path(sc.RANK_STEPS_DROPPED)} AS BIGINT)), max(epoch_ns(ts))
FROM events WHERE run_id = $run AND event = '{sc.EVENT_TELEMETRY_LOSS}' AND ts > make_timestamp_ns($since)
GROUP BY rank"""
REPORTS_SLACK_S = 300  # reports read again behind the newest read: ranks export apart, a batch may come late


@dataclass(frozen=True)
class Reports:
    """What a run's agents reported: each rank's largest counts (spans, rank-steps), and the newest
    report read (what the next pass reads after, less REPORTS_SLACK_S)."""

    by_rank: dict[int, tuple[int, int]] = field(default_factory=dict)
    seen_ns: int = 0

    def read(self, con: duckdb.DuckDBPyConnection, run_id: str) -> "Reports":
        """These, with the reports that came since."""
        by_rank, seen_ns = dict(self.by_rank), self.seen_ns
        since = seen_ns - REPORTS_SLACK_S * 10**9 if seen_ns else 0
        for rank, spans, steps, at in con.execute(_REPORTS, {"run": run_id, "since": since}).fetchall():
            old = by_rank.get(int(rank), (0, 0))
            by_rank[int(rank)] = (max(old[0], int(spans or 0)), max(old[1], int(steps or 0)))
            seen_ns = max(seen_ns, int(at))
        return Reports(by_rank, seen_ns)

    def loss(self, seen: Gaps) -> Loss:
        return Loss(seen, sum(s for s, _ in self.by_rank.values()), sum(n for _, n in self.by_rank.values()))


def record(con: duckdb.DuckDBPyConnection, run_id: str, final: bool = False) -> Loss:
    """One live pass: the run's steps settled since the last, judged, and its agents' new reports,
    recorded (`final`: every step settles, its newest too, in as many windows as that takes). Written
    whenever it differs from the row stored: rank-steps taken off the count as they come late are recorded
    even where no step settles with them (a run that ended, or stopped sending)."""
    recorded, reports = stored(con, run_id)
    ranks = con.execute(_RANKS, {"run": run_id}).fetchall()[0][0]
    # ranks heard from after steps settled without them: counted again from the start
    recount = ranks != recorded.ranks and recorded.settled_step != NOT_SETTLED
    before = _arrived(con, run_id, Gaps() if recount else recorded)
    after = _advance(con, run_id, before, ranks, _bound(con, run_id, before.settled_step, final), 0 if final else 1)
    now = reports.read(con, run_id)
    loss = now.loss(after)
    if after != recorded or recorded.ranks != ranks or now != reports:
        row = (after.settled_step, ranks, after.expected, after.missing, json.dumps(after.blocks), after.left_out)
        agents = (loss.spans_dropped, loss.rank_steps_dropped, json.dumps(now.by_rank), now.seen_ns)
        con.execute(_RECORD, [run_id, *row, *agents])
    return loss


def measure(con: duckdb.DuckDBPyConnection, run_id: str) -> Loss:
    """A whole run's loss, every step settled (after the fact: `rankwatch analyze`); reads only."""
    ranks = con.execute(_RANKS, {"run": run_id}).fetchall()[0][0]
    found = _advance(con, run_id, Gaps(), ranks, _bound(con, run_id, NOT_SETTLED, True), 0)
    return Reports().read(con, run_id).loss(found)


def stored(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[Gaps, Reports]:
    """What the live passes recorded of a run so far."""
    row = con.execute(_STORED, [run_id]).fetchone()
    if row is None:
        return Gaps(), Reports()
    settled, ranks, expected, missing, blocks, left_out, by_rank, seen_ns = row
    reports = Reports({int(r): (s, n) for r, (s, n) in json.loads(by_rank).items()}, seen_ns)
    return Gaps(settled, ranks, expected, missing, json.loads(blocks), left_out), reports


def _arrived(con: duckdb.DuckDBPyConnection, run_id: str, found: Gaps) -> Gaps:
    """`found` less the rank-steps that came since they were counted missing: each kept gap into which
    some came is drawn anew from what is still missing in it (one query when none came)."""
    if not found.blocks:
        return found
    columns = dict(zip(("r0", "r1", "s0", "s1"), zip(*((b[0], b[1], b[2], b[3]) for b in found.blocks), strict=True)))
    came = dict(con.execute(_ARRIVED, {"run": run_id, **{k: list(v) for k, v in columns.items()}}).fetchall())
    if not came:
        return found
    redrawn, left_out = [], found.left_out
    for i, block in enumerate(found.blocks, 1):
        if i not in came:
            redrawn.append(block)
            continue
        window = {"run": run_id, "r0": block[0], "r1": block[1], "s0": block[2], "s1": block[3]}
        within = {"run": run_id, "s0": block[2], "s1": block[3]}
        steps = np.array([s for (s,) in con.execute(_STEPS_WITHIN, within).fetchall()], dtype=np.int64)
        still = gaps.judge(Gaps(), con.execute(_STILL_MISSING, window).df(), steps, 0)
        redrawn, left_out = redrawn + still.blocks, left_out + still.left_out
    return gaps.regapped(found, redrawn, left_out)


def _bound(con: duckdb.DuckDBPyConnection, run_id: str, after: int, final: bool) -> int | None:
    """The newest step settled (None: none after `after`)."""
    newest, newest_end = con.execute(_NEWEST, {"run": run_id, "after": after}).fetchall()[0]
    if newest is None or final:
        return newest
    window = {"run": run_id, "after": after, "upto": newest - MARGIN_STEPS, "until": int(newest_end - MARGIN_S * 1e9)}
    return con.execute(_SETTLED, window).fetchall()[0][0]


def _advance(
    con: duckdb.DuckDBPyConnection, run_id: str, before: Gaps, ranks: int, bound: int | None, windows: int
) -> Gaps:
    """`before` judged on through `bound`, a window of at most RANK_STEPS rank-steps at a time, at most
    `windows` of them (0: as many as it takes)."""
    budget, done = max(RANK_STEPS // max(ranks, 1), 1), 0
    while bound is not None and before.settled_step < bound and (not windows or done < windows):
        window = {"run": run_id, "after": before.settled_step, "upto": bound}
        nth = con.execute(_NTH_STEP, {**window, "n": budget - 1}).fetchone()
        if nth is not None:
            window["upto"] = int(nth[0])
        steps = np.array([s for (s,) in con.execute(_STEPS, window).fetchall()], dtype=np.int64)
        if len(steps) == 0:
            break
        before = gaps.judge(before, con.execute(_MISSING, window).df(), steps, ranks)
        done += 1
    return before

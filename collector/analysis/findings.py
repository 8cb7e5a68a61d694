"""Findings in the store: an analyzer's conclusions for a run become rows that stay `firing`
while they hold and turn `resolved` when they stop. Each change is published to the consumers given
(collector/findings.py's `Consumer.on_changes`) inside its transaction, so that what they write (the
alerts it raises or ends: collector/alerts/outbox.py) commits with it or not at all. A finding still
firing when its run ends turns `ended`, not `resolved`: it held to the end, so it is what went wrong
with the run, not a recovery."""

import json
from collections.abc import Mapping, Sequence

import duckdb

from collector.analysis.analyzers import Reads
from collector.findings import Changes, Consumer, Finding
from collector.store.lake import next_id
from collector.store.schema import RESOLVED

_FIRING = """SELECT id, kind, ranks, step_start, step_end, score FROM findings
             WHERE run_id = ? AND analyzer = ? AND state = 'firing'"""
_FIRING_OF_RUN = """SELECT id, analyzer, kind, ranks, step_start, step_end, score FROM findings
                    WHERE run_id = ? AND state = 'firing'"""
# An episode that stopped of itself (not ended by a rollback or the run's end) holding a finding's steps, with no
# rollback applied since that went back to them: steps judged again since late steps came under them (a rank's
# batch committed after later ones) draw what it recorded, not a new episode.
_RECORDED = """SELECT count(*) FROM findings f
               WHERE run_id = $run AND analyzer = $analyzer AND kind = $kind AND ranks = $ranks::INTEGER[]
                 AND state = 'resolved' AND (evidence->>'resolved') IS NULL
                 AND step_start <= $start AND step_end >= $end
                 AND (SELECT count(*) FROM commands c
                      WHERE c.run_id = f.run_id AND c.kind = 'rollback' AND c.state = 'applied'
                        AND TRY_CAST(c.result->>'restored_step' AS BIGINT) <= $end
                        AND c.updated_at >= f.created_at) = 0"""


def record(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    analyzer: str,
    findings: list[Finding],
    consumers: Sequence[Consumer] = (),
) -> None:
    """Make the firing rows of (run, analyzer) match `findings`, an analyzer's latest conclusions
    drawn afresh (the collector's health, power recommendations): same kind and ranks update the
    row (its span too: an onset estimated from a few slow steps sharpens as more come, and the row
    must say what its summary says), new ones insert, the rest resolve; the change published to
    `consumers`."""
    with _transaction(con):
        firing = {
            (kind, tuple(ranks)): row[0]
            for row in con.execute(_FIRING, [run_id, analyzer]).fetchall()
            for kind, ranks in [row[1:3]]
        }
        drawn = []
        for f in findings:
            fid = firing.pop((f.kind, tuple(f.ranks)), None)
            drawn.append((_update(con, fid, f) if fid is not None else _insert(con, run_id, analyzer, f), f))
        _resolve(con, list(firing.values()))
        _publish(con, consumers, Changes(run_id, analyzer, drawn, list(firing.values())))


def record_pass(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    found: Mapping[str, list[Finding]],
    reads: Mapping[str, Reads],
    last: int,
    consumers: Sequence[Consumer] = (),
    cursor: tuple[int, int, int] | None = None,
) -> None:
    """One pass of the engine over a run, in one transaction: each finding goes on the firing row
    of its episode (same analyzer, kind and ranks, and `Reads.continues`; its span widened to both,
    the strongest finding speaking for it) or starts one, unless an episode that stopped holds it
    already (its steps judged again: `_RECORDED`), and the episodes of the analyzers that
    judged resolve where `Reads.holds` says they no longer fire once the steps up to `last` are
    judged (collector/analysis/engine.py's `merge`, on rows); each analyzer's changes published to
    `consumers`. `cursor`: (step, rollback, world) the engine stands at after the pass, recorded with
    its findings (a step is judged once, across restarts too)."""
    with _transaction(con):
        if cursor is not None:
            con.execute("INSERT OR REPLACE INTO analysis_cursors VALUES (?, ?, ?, ?)", [run_id, *cursor])
        rows = con.execute(_FIRING_OF_RUN, [run_id]).fetchall() if found else []
        for analyzer, drawn in found.items():
            rules = reads[analyzer]
            firing = {
                (kind, tuple(ranks)): [fid, start, end, False, score]
                for fid, of, kind, ranks, start, end, score in rows
                if of == analyzer
            }
            changed, ended = [], []
            for f in sorted(drawn, key=lambda f: (f.step_start is None, f.step_start or 0)):
                key = (f.kind, tuple(f.ranks))
                row = firing.get(key)
                if row is not None and row[2] is not None and rules.continues(row[2], f):
                    assert f.step_start is not None and f.step_end is not None  # as continues() says
                    f = f.spanning(min(row[1], f.step_start), max(row[2], f.step_end))
                    if (row[4] or 0.0) > f.score:  # the strongest finding of an episode speaks for it, since its onset
                        con.execute(
                            r"""UPDATE findings SET summary = regexp_replace(summary, '\bsince step ' || step_start
                                                                              || '\b', 'since step ' || $1),
                                                   step_start = $1, step_end = $2, updated_at = now() WHERE id = $3""",
                            [f.step_start, f.step_end, row[0]],
                        )
                    else:
                        changed.append((_update(con, row[0], f), f))
                else:
                    if _recorded(con, run_id, analyzer, f):
                        continue
                    if row is not None:
                        ended.append(row[0])
                    row = [_insert(con, run_id, analyzer, f), f.step_start, f.step_end, False, f.score]
                    changed.append((row[0], f))
                row[1:4] = [f.step_start, f.step_end, True]
                row[4] = max(row[4] or 0.0, f.score)
                firing[key] = row
            ended += [
                fid for fid, _, end, redrawn, _ in firing.values() if end is None or not rules.holds(end, last, redrawn)
            ]
            _resolve(con, ended)
            _publish(
                con, consumers, Changes(run_id, analyzer, [(fid, f) for fid, f in changed if fid not in ended], ended)
            )


def _recorded(con: duckdb.DuckDBPyConnection, run_id: str, analyzer: str, f: Finding) -> bool:
    """Whether `f` is an episode already recorded that stopped of itself (`_RECORDED`)."""
    if f.step_start is None or f.step_end is None:
        return False
    span = {"run": run_id, "analyzer": analyzer, "kind": f.kind, "ranks": list(f.ranks)}
    return bool(con.execute(_RECORDED, {**span, "start": f.step_start, "end": f.step_end}).fetchall()[0][0])


def end_run(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    reason: str,
    consumers: Sequence[Consumer] = (),
    since_step: int | None = None,
    keep: tuple[str, ...] = (),
    state: str = RESOLVED,
) -> None:
    """Take a run's firing findings off firing, saying why in their evidence (`resolved`: "rolled
    back", say), and publish them as ended (once: nothing fires again for them); `state`: what they
    become (`ENDED` at the run's end: they held to it); `since_step`: only those that began at it or
    after (the steps a rollback abandoned); `keep`: analyzers whose findings stay."""
    rows = [
        (fid, analyzer)
        for fid, analyzer, start in con.execute(
            "SELECT id, analyzer, step_start FROM findings WHERE run_id = ? AND state = 'firing'", [run_id]
        ).fetchall()
        if analyzer not in keep and (since_step is None or (start is not None and start >= since_step))
    ]
    if not rows:
        return
    with _transaction(con):
        _resolve(con, [fid for fid, _ in rows], reason, state)
        for analyzer in {a for _, a in rows}:
            _publish(con, consumers, Changes(run_id, analyzer, [], [fid for fid, a in rows if a == analyzer]))


def _publish(con: duckdb.DuckDBPyConnection, consumers: Sequence[Consumer], changes: Changes) -> None:
    """A change, to each consumer in turn, in the caller's transaction (what one raises rolls it back)."""
    for consumer in consumers:
        consumer.on_changes(con, changes)


class _transaction:
    """One transaction, rolled back on any error."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con

    def __enter__(self):
        self.con.begin()

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.con.commit()
        else:
            self.con.rollback()


def _insert(con: duckdb.DuckDBPyConnection, run_id: str, analyzer: str, f: Finding) -> int:
    fid = next_id(con, "findings_id")
    con.execute(
        """INSERT INTO findings (id, run_id, analyzer, kind, ranks, step_start, step_end, severity, score,
                          summary, evidence) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        [
            fid,
            run_id,
            analyzer,
            f.kind,
            f.ranks,
            f.step_start,
            f.step_end,
            f.severity,
            f.score,
            f.summary,
            json.dumps(f.evidence, default=str),
        ],
    )
    return fid


def _update(con: duckdb.DuckDBPyConnection, fid: int, f: Finding) -> int:
    con.execute(
        """UPDATE findings SET step_start = ?, step_end = ?, severity = ?, score = ?, summary = ?,
                   evidence = ?, updated_at = now() WHERE id = ?""",
        [f.step_start, f.step_end, f.severity, f.score, f.summary, json.dumps(f.evidence, default=str), fid],
    )
    return fid


def _resolve(con: duckdb.DuckDBPyConnection, ids: list[int], reason: str | None = None, state: str = RESOLVED) -> None:
    for fid in ids:
        if reason is None:
            con.execute("UPDATE findings SET state = ?, updated_at = now() WHERE id = ?", [state, fid])
        else:
            con.execute(
                """UPDATE findings SET state = ?, updated_at = now(),
                           evidence = json_merge_patch(coalesce(evidence, '{}'), ?) WHERE id = ?""",
                [state, json.dumps({"resolved": reason}), fid],
            )

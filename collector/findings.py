"""Findings in the store: an analyzer's latest conclusions for a run become rows that
stay `firing` while it keeps drawing them and turn `resolved` when it stops."""

import json

import duckdb

from collector.alerts import outbox
from collector.alerts.config import AlertConfig
from collector.analyzers import Finding


def record(con: duckdb.DuckDBPyConnection, run_id: str, analyzer: str, findings: list[Finding],
           alerts: AlertConfig | None = None) -> None:
    """Make the firing rows of (run, analyzer) match `findings`: same kind and ranks update
    the row (its span too: an onset estimated from a few slow steps sharpens as more come, and
    the row must say what its summary says), new ones insert, the rest resolve. With `alerts`,
    the alerts and notifications these changes raise are written in the same transaction
    (collector/alerts/outbox.py)."""
    firing = {(kind, tuple(ranks)): fid for fid, kind, ranks in con.execute(
        "SELECT id, kind, ranks FROM findings WHERE run_id = ? AND analyzer = ? AND state = 'firing'",
        [run_id, analyzer]).fetchall()}
    drawn = []
    con.begin()
    try:
        for f in findings:
            evidence = json.dumps(f.evidence, default=str)
            fid = firing.pop((f.kind, tuple(f.ranks)), None)
            if fid is None:
                (fid,) = con.execute("""INSERT INTO findings (run_id, analyzer, kind, ranks, step_start, step_end,
                                        severity, score, summary, evidence) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                                        RETURNING id""",
                                     [run_id, analyzer, f.kind, f.ranks, f.step_start, f.step_end, f.severity,
                                      f.score, f.summary, evidence]).fetchone()
            else:
                con.execute("""UPDATE findings SET step_start = ?, step_end = ?, severity = ?, score = ?, summary = ?,
                               evidence = ?, updated_at = now() WHERE id = ?""",
                            [f.step_start, f.step_end, f.severity, f.score, f.summary, evidence, fid])
            drawn.append((fid, f))
        for fid in firing.values():
            con.execute("UPDATE findings SET state = 'resolved', updated_at = now() WHERE id = ?", [fid])
        if alerts is not None:
            outbox.notify(con, alerts, run_id, analyzer, drawn, list(firing.values()))
        con.commit()
    except Exception:
        con.rollback()
        raise

"""The alert outbox: alerts and their notifications, written in the transaction that changes
the findings (`Outbox`, a consumer of what the analysis publishes: collector/findings.py), and read
back by the delivery thread.

A notification is committed with its finding change or not at all, so a collector killed at
any moment neither loses an alert nor sends one for a change it rolled back; delivery.py
posts it later, however long the receiver is away. notify() runs in the writer's thread and
only inserts rows (and ends alerts); the delivery thread, on a cursor of its own, only moves
outbox rows along: the two never write the same row.
"""

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import ClassVar

import duckdb

from collector.alerts import rules, webhook
from collector.alerts.config import AlertConfig
from collector.findings import NOT_JUDGED, Changes, Consumer, Finding

_OPEN = """SELECT id, finding_id, labels, annotations, starts_at, fingerprint FROM alerts
           WHERE run_id = ? AND analyzer = ? AND ends_at IS NULL"""


@dataclass(frozen=True)
class Notification:
    """An outbox row waiting to be posted."""

    id: int
    receiver: str
    webhook_id: str
    body: str
    attempts: int
    created_at: datetime


@dataclass(frozen=True)
class Outbox(Consumer):
    """The alerts of the analysis's finding changes, each written in the change's transaction for the
    receivers of `config`; a verdict an analyzer could not draw (NOT_JUDGED) pages nobody."""

    config: AlertConfig
    name: ClassVar[str] = "alerts"

    def on_changes(self, con: duckdb.DuckDBPyConnection, changes: Changes) -> None:
        judged = [(fid, f) for fid, f in changes.drawn if f.kind != NOT_JUDGED]
        notify(con, self.config, changes.run_id, changes.analyzer, judged, changes.ended)


def notify(
    con: duckdb.DuckDBPyConnection,
    config: AlertConfig,
    run_id: str,
    analyzer: str,
    drawn: list[tuple[int, Finding]],
    resolved: list[int],
) -> None:
    """Alerts for one analysis of (run, analyzer), inside the caller's transaction: a drawn
    finding without an open alert starts one, one whose severity rose ends its alert and starts
    another, a resolved one ends its alert, one whose evidence now says where every rank is (a hang's
    stacks, rules.annotations) is sent again, firing, with it. The changes are one group: each receiver
    that wants any of them gets one notification. A finding redrawn otherwise unchanged notifies nobody."""
    if not drawn and not resolved:
        return
    now = datetime.now(UTC)
    open_alerts = {row[1]: row for row in con.execute(_OPEN, [run_id, analyzer]).fetchall()}
    changed = []
    for finding_id, finding in drawn:
        current = open_alerts.get(finding_id)
        if current is not None and not rules.escalates(json.loads(current[2])["severity"], finding.severity):
            if (again := _told_more(con, current, finding)) is not None:
                changed.append(again)
            continue
        if current is not None:
            changed.append(_end(con, current, now))
        changed.append(_start(con, config, run_id, analyzer, finding_id, finding, now))
    changed += [_end(con, open_alerts[finding_id], now) for finding_id in resolved if finding_id in open_alerts]
    if not changed:
        return
    group = rules.group_labels(changed[0]["labels"])
    for receiver in config.receivers:
        wanted = [a for a in changed if receiver.wants(a["labels"])]
        if wanted:
            con.execute(
                "INSERT INTO outbox (receiver, webhook_id, body) VALUES (?, ?, ?)",
                [receiver.name, webhook.new_id(), webhook.message(receiver.name, wanted, group, config.dashboard_url)],
            )


def _start(
    con: duckdb.DuckDBPyConnection,
    config: AlertConfig,
    run_id: str,
    analyzer: str,
    finding_id: int,
    finding: Finding,
    now: datetime,
) -> dict:
    labels = rules.labels(run_id, analyzer, finding.kind, finding.ranks, finding.severity, finding.evidence)
    link = rules.dashboard_link(config.dashboard_url, run_id, analyzer, finding_id)
    annotations, fingerprint = rules.annotations(finding.summary, link, finding.evidence), rules.fingerprint(labels)
    con.execute(
        """INSERT INTO alerts (finding_id, run_id, analyzer, fingerprint, labels, annotations, starts_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?)""",
        [finding_id, run_id, analyzer, fingerprint, json.dumps(labels), json.dumps(annotations), now],
    )
    return webhook.alert("firing", labels, annotations, now, None, link, fingerprint)


def _told_more(con: duckdb.DuckDBPyConnection, row: tuple, finding: Finding) -> dict | None:
    """The open alert of `row` again, firing, where its finding's evidence now says where every rank is and
    the alert did not say so yet (the stacks come seconds after the hang first fired); else None."""
    alert_id, _, labels, stored, starts_at, fingerprint = row
    stored = json.loads(stored)
    annotations = rules.annotations(finding.summary, stored["dashboard"], finding.evidence)
    if annotations.get("stacks") in (None, stored.get("stacks")):
        return None
    con.execute("UPDATE alerts SET annotations = ? WHERE id = ?", [json.dumps(annotations), alert_id])
    return webhook.alert("firing", json.loads(labels), annotations, starts_at, None, stored["dashboard"], fingerprint)


def _end(con: duckdb.DuckDBPyConnection, row: tuple, now: datetime) -> dict:
    alert_id, _, labels, annotations, starts_at, fingerprint = row
    con.execute("UPDATE alerts SET ends_at = ? WHERE id = ?", [now, alert_id])
    annotations = json.loads(annotations)
    return webhook.alert(
        "resolved", json.loads(labels), annotations, starts_at, now, annotations["dashboard"], fingerprint
    )


def due(con: duckdb.DuckDBPyConnection, limit: int = 100) -> list[Notification]:
    """Pending notifications whose time has come, oldest first; one waits while an older one for
    its receiver still does (written after a failure's postponement, it would otherwise overtake
    it: a resolution before its firing)."""
    return [
        Notification(*row)
        for row in con.execute(
            """SELECT id, receiver, webhook_id, body, attempts, created_at FROM outbox o
           WHERE state = 'pending' AND next_attempt_at <= now()
             AND NOT EXISTS (SELECT 1 FROM outbox w WHERE w.receiver = o.receiver AND w.state = 'pending'
                                                       AND w.id < o.id AND w.next_attempt_at > now())
           ORDER BY id LIMIT ?""",
            [limit],
        ).fetchall()
    ]


def settle(con: duckdb.DuckDBPyConnection, notification: Notification, state: str, error: str | None = None) -> None:
    """Move a notification out of pending: delivered (this attempt worked), expired or dropped."""
    con.execute(
        """UPDATE outbox SET state = ?, attempts = attempts + ?, last_error = ?, settled_at = now()
                   WHERE id = ?""",
        [state, int(state == "delivered"), error, notification.id],
    )


def postpone(con: duckdb.DuckDBPyConnection, notification: Notification, delay_s: float, error: str) -> None:
    """A failed attempt: this notification and every other one pending for its receiver wait at
    least `delay_s`, so a receiver that is down gets one try per interval, not one per alert."""
    con.execute(
        """UPDATE outbox SET next_attempt_at = greatest(next_attempt_at, now() + to_microseconds(?)),
                          attempts = attempts + CAST(id = ? AS INTEGER),
                          last_error = CASE WHEN id = ? THEN ? ELSE last_error END
                   WHERE receiver = ? AND state = 'pending'""",
        [int(delay_s * 1e6), notification.id, notification.id, error, notification.receiver],
    )


def counts(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, int]]:
    """(receiver, state, notifications) over the whole outbox; a receiver that older collectors named by
    its URL is labelled as config.default_name labels it now, so no URL reaches /metrics."""
    return con.execute(
        """SELECT CASE WHEN receiver LIKE '%://%' THEN 'webhook-' || left(sha256(receiver), 10) ELSE receiver END,
                  state, count(*) FROM outbox GROUP BY ALL ORDER BY ALL"""
    ).fetchall()

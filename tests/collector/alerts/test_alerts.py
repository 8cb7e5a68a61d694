"""Alert webhooks: findings become Alertmanager (v4) notifications in a durable outbox, signed
per Standard Webhooks and delivered with retries.

Covered: the rules (labels, grouping, no repeat for a finding redrawn, which keeps its row and
takes the latest span, escalation, a resolved alert with the firing one's fingerprint, receivers'
filters); the receivers file's checks; the signature against the spec's test vector; delivery to
a real receiver that is down, then up (every notification once, signatures verified by the test's
own implementation of the spec); a collector killed with kill -9 while the receiver is down loses
nothing after a restart; `rankwatch alerts test`.
"""

import json
import re
import signal
import time
from dataclasses import replace

import duckdb
import pytest

from collector.alerts import outbox, rules, webhook
from collector.alerts.config import AlertConfig, AlertConfigError, Receiver, default_name, load
from collector.alerts.delivery import Delivery
from collector.alerts.outbox import Outbox
from collector.analysis import findings
from collector.analysis.analyzers import Finding
from collector.store.schema import DDL
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support.collectors import free_port
from tests.support.commands import rankwatch_cli
from tests.support.otlp_payloads import query
from tests.support.paths import ROOT
from tests.support.straggler_steps import MS, alerts_pending, send_straggler_steps
from tests.support.waits import wait_until
from tests.support.webhook_receiver import Receiver as WebhookReceiver

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the Standard Webhooks spec's example secret


def straggler(ranks: list[int], severity: str = "warning") -> Finding:
    return Finding(
        "run-a", "rank", ranks, 10, 20, severity, 1.3, f"rank {ranks} computes 30% slower", analyzer="stragglers"
    )


def notifications(con) -> list[tuple[str, dict]]:
    return [
        (receiver, json.loads(body))
        for receiver, body in con.execute("SELECT receiver, body FROM outbox ORDER BY id").fetchall()
    ]


@pytest.fixture
def con():
    con = duckdb.connect()
    con.execute(DDL)
    return con


def test_a_new_finding_sends_one_v4_notification_per_receiver_and_group(con):
    config = AlertConfig(receivers=(Receiver("all", "http://a/"),), dashboard_url="http://dash:8501")
    findings.record(con, "run-a", "stragglers", [straggler([3]), straggler(list(range(24, 32)))], [Outbox(config)])
    ((receiver, body),) = notifications(con)
    assert receiver == "all"
    assert set(body) == {
        "version",
        "groupKey",
        "truncatedAlerts",
        "status",
        "receiver",
        "groupLabels",
        "commonLabels",
        "commonAnnotations",
        "externalURL",
        "alerts",
    }
    assert (body["version"], body["status"], body["receiver"], body["truncatedAlerts"]) == ("4", "firing", "all", 0)
    assert body["groupKey"] == '{}:{alertname="RankwatchStraggler", run="run-a"}'
    assert body["groupLabels"] == {"alertname": "RankwatchStraggler", "run": "run-a"}
    assert body["commonLabels"] == {
        "alertname": "RankwatchStraggler",
        "run": "run-a",
        "analyzer": "stragglers",
        "kind": "rank",
        "severity": "warning",
    }
    assert body["externalURL"] == "http://dash:8501"
    first, second = body["alerts"]
    assert set(first) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
    assert (first["labels"]["ranks"], second["labels"]["ranks"]) == ("3", "24-31")
    assert first["annotations"]["summary"] == "rank [3] computes 30% slower"
    finding_id = con.execute("SELECT id FROM findings WHERE ranks = [3]").fetchone()[0]
    assert (
        first["annotations"]["dashboard"]
        == first["generatorURL"]
        == f"http://dash:8501/stragglers?run=run-a&finding={finding_id}"
    )
    assert first["endsAt"] == "0001-01-01T00:00:00Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["startsAt"])
    assert first["fingerprint"] == rules.fingerprint(first["labels"]) != second["fingerprint"]


def test_a_finding_redrawn_notifies_nobody_and_its_resolution_once(con):
    config = AlertConfig(receivers=(Receiver("all", "http://a/"),))
    for _ in range(3):
        findings.record(con, "run-a", "stragglers", [straggler([3])], [Outbox(config)])
    findings.record(con, "run-a", "stragglers", [], [Outbox(config)])
    findings.record(con, "run-a", "stragglers", [], [Outbox(config)])
    (_, fired), (_, resolved) = notifications(con)
    assert resolved["status"] == "resolved"
    (firing_alert,), (resolved_alert,) = fired["alerts"], resolved["alerts"]
    assert resolved_alert["status"] == "resolved"
    assert resolved_alert["fingerprint"] == firing_alert["fingerprint"]
    assert resolved_alert["labels"] == firing_alert["labels"]
    assert resolved_alert["startsAt"] == firing_alert["startsAt"] < resolved_alert["endsAt"]


def test_a_finding_redrawn_keeps_its_row_and_takes_the_latest_span_and_words(con):
    """The straggler analyzer's onset sharpens as slow steps accumulate; the row follows it."""
    findings.record(con, "run-a", "stragglers", [straggler([3])])
    ((first_id,),) = con.execute("SELECT id FROM findings").fetchall()
    sharper = replace(straggler([3]), step_start=15, step_end=40, summary="rank [3] slower since step 15")
    findings.record(con, "run-a", "stragglers", [sharper])
    assert con.execute("SELECT id, step_start, step_end, summary, state FROM findings").fetchall() == [
        (first_id, 15, 40, "rank [3] slower since step 15", "firing")
    ]


def test_escalation_to_critical_sends_again_and_never_back(con):
    config = AlertConfig(
        receivers=(Receiver("all", "http://a/"), Receiver("pager", "http://p/", severities=frozenset({"critical"})))
    )
    findings.record(con, "run-a", "stragglers", [straggler([3], "warning")], [Outbox(config)])
    findings.record(con, "run-a", "stragglers", [straggler([3], "critical")], [Outbox(config)])
    findings.record(con, "run-a", "stragglers", [straggler([3], "warning")], [Outbox(config)])  # no flapping back
    sent = notifications(con)
    assert [(r, [(a["status"], a["labels"]["severity"]) for a in b["alerts"]]) for r, b in sent] == [
        ("all", [("firing", "warning")]),
        ("all", [("resolved", "warning"), ("firing", "critical")]),
        ("pager", [("firing", "critical")]),
    ]


def test_receivers_filter_by_analyzer_kind_and_severity(con):
    config = AlertConfig(
        receivers=(
            Receiver("hangs", "http://h/", analyzers=frozenset({"hangs"})),
            Receiver("nodes", "http://n/", kinds=frozenset({"node"})),
            Receiver("critical", "http://c/", severities=frozenset({"critical"})),
        )
    )
    findings.record(con, "run-a", "stragglers", [straggler([3])], [Outbox(config)])
    assert notifications(con) == []
    hang = Finding("run-a", "hang", [1], 4, 4, "critical", 2.0, "rank 1 is stuck", analyzer="hangs")
    findings.record(con, "run-a", "hangs", [hang], [Outbox(config)])
    assert [(r, b["alerts"][0]["labels"]["alertname"]) for r, b in notifications(con)] == [
        ("hangs", "RankwatchHang"),
        ("critical", "RankwatchHang"),
    ]


def test_alerts_are_kept_without_receivers(con):
    findings.record(con, "run-a", "stragglers", [straggler([3])], [Outbox(AlertConfig())])
    assert con.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    assert con.execute("SELECT labels->>'alertname', ends_at FROM alerts").fetchall() == [("RankwatchStraggler", None)]


def test_a_notification_never_overtakes_an_older_one_of_its_receiver(con):
    config = AlertConfig(receivers=(Receiver("hook", "http://127.0.0.1:9/hook"),))
    findings.record(con, "run-a", "stragglers", [straggler([3])], [Outbox(config)])
    (fired,) = outbox.due(con)
    outbox.postpone(con, fired, 60, "connection refused")  # the receiver is down
    findings.record(con, "run-a", "stragglers", [], [Outbox(config)])  # the resolution, written after the postponement
    assert outbox.due(con) == []  # not before the firing notification it resolves
    con.execute("UPDATE outbox SET next_attempt_at = now() - INTERVAL 1 SECOND")  # the wait is over
    assert [n.id for n in outbox.due(con)] == [fired.id, fired.id + 1]


def test_short_ranks_and_fingerprint():
    assert rules.short_ranks([]) == "none"
    assert rules.short_ranks([7, 3, 4, 5, 9]) == "3-5,7,9"
    assert rules.short_ranks(list(range(0, 40, 2))) == "0,2,4,6... +16"
    # prometheus/common model's own signature test: Alertmanager computes fingerprints the same way
    assert int(rules.fingerprint({"name": "garland, briggs", "fear": "love is not enough"}), 16) == 5799056148416392346


def test_signature_matches_the_standard_webhooks_test_vector():
    assert (
        webhook.sign(SECRET, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
        == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    )


@pytest.mark.parametrize(
    "text, error",
    [
        ('[[receivers]]\nurl = "ftp://x"', "receiver 1: url must be an http:// or https:// URL"),
        ('[[receivers]]\nurl = "http://[::1/x"', "receiver 1: url is not valid: Invalid port"),
        ('[[receivers]]\nurl = "http://x"\nsecret = "abc"', "receiver 1: a webhook secret starts with 'whsec_'"),
        ('[[receivers]]\nurl = "http://x"\nsecret = "whsec_!!"', "must be base64"),
        ('[[receivers]]\nurl = "http://x"\nseverity = ["critical"]', "receiver 1: unknown key 'severity'"),
        ("backoff_max_s = 0", "backoff_max_s must be a positive number of seconds"),
        ('[[receivers]]\nurl = "http://x"\n[[receivers]]\nurl = "http://x"', "two receivers are named 'webhook-"),
        ('[[receivers]]\nname = "http://x/T0SECRET"\nurl = "http://x/T0SECRET"', "name must be a short label"),
        ("receivers = [", ""),
    ],
)
def test_receivers_file_mistakes_are_one_line_errors(tmp_path, text, error):
    path = tmp_path / "alerts.toml"
    path.write_text(text)
    with pytest.raises(AlertConfigError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: ") and error in str(e.value) and "\n" not in str(e.value)


def test_receivers_file_in_json(tmp_path):
    path = tmp_path / "alerts.json"
    path.write_text(
        json.dumps(
            {
                "dashboard_url": "http://d",
                "receivers": [{"name": "a", "url": "https://x/y", "secret": SECRET, "kinds": ["hang"]}],
            }
        )
    )
    assert load(path) == AlertConfig(
        receivers=(Receiver("a", "https://x/y", SECRET, kinds=frozenset({"hang"})),), dashboard_url="http://d"
    )


def test_the_example_receivers_file_loads():
    config = load(ROOT / "examples" / "alerts.toml")
    assert [r.name for r in config.receivers] == ["team-chat", "oncall-hangs", "oncall-critical", "platform"]
    assert config.receivers[-1].wants({"analyzer": "collector"}) and not config.receivers[-1].wants(
        {"analyzer": "stragglers"}
    )


def test_a_receiver_down_then_up_gets_every_notification_once(tmp_path):
    port = free_port()
    config = AlertConfig(
        receivers=(Receiver("hook", f"http://127.0.0.1:{port}/hook", SECRET),), backoff_initial_s=0.1, backoff_max_s=0.4
    )
    con = duckdb.connect(str(tmp_path / "store.duckdb"))
    con.execute(DDL)
    findings.record(con, "run-a", "stragglers", [straggler([3])], [Outbox(config)])
    delivery = Delivery(config)
    delivery.start(con)
    try:
        wait_until(
            lambda: con.execute("SELECT attempts FROM outbox").fetchone()[0] >= 3,  # refused, retried
            "the receiver that is down was not retried",
        )
        findings.record(con, "run-a", "stragglers", [straggler([5])], [Outbox(config)])  # queued while it is down
        receiver = WebhookReceiver(port, SECRET).start()
        try:
            arrived = receiver.wait_for(2)
            time.sleep(1.0)  # a few more passes: nothing comes twice
        finally:
            receiver.stop()
    finally:
        delivery.close()
    outbox = con.execute("SELECT webhook_id, body, state FROM outbox ORDER BY id").fetchall()
    assert [d.webhook_id for d in receiver.deliveries] == [webhook_id for webhook_id, _, _ in outbox]
    assert all(d.verified for d in receiver.deliveries)
    assert [d.body for d in receiver.deliveries] == [json.loads(body) for _, body, _ in outbox]
    assert {state for _, _, state in outbox} == {"delivered"}
    assert [a["status"] for d in arrived for a in d.body["alerts"]] == ["firing", "firing", "resolved"]


def test_backoff_grows_to_its_cap_with_jitter():
    delivery = Delivery(AlertConfig(backoff_initial_s=1.0, backoff_max_s=8.0))
    waits = [[delivery.backoff_s(attempts) for _ in range(50)] for attempts in range(6)]
    for attempts, samples in enumerate(waits):
        cap = min(8.0, 2.0**attempts)
        assert all(cap / 2 <= w <= cap for w in samples) and len(set(samples)) > 1


def test_kill_9_while_the_receiver_is_down_loses_no_alert(collector_factory, tmp_path):
    port = free_port()
    alerts = tmp_path / "alerts.toml"
    alerts.write_text(
        f'backoff_initial_s = 0.2\nbackoff_max_s = 1\n[[receivers]]\nname = "oncall"\n'
        f'url = "http://127.0.0.1:{port}/hook"\nsecret = "{SECRET}"\n'
    )
    args = ("--analyze-every", "0.5", "--alerts", str(alerts))
    collector = collector_factory(None, *args)
    exporters = {r: Exporter(collector.url, collector.token, {sc.RUN_ID: "run-alerts", sc.RANK: r}) for r in range(6)}
    t0 = time.time_ns() - 30_000 * MS
    send_straggler_steps(exporters, range(30), t0, slow_rank=2)
    wait_until(lambda: alerts_pending(collector) >= 1, "the straggler's alert was never queued")
    time.sleep(1.5)  # refused and retried
    assert collector.stop(signal.SIGKILL) == -signal.SIGKILL
    collector = collector_factory(collector.db, *args)
    exporters = {r: Exporter(collector.url, collector.token, {sc.RUN_ID: "run-alerts", sc.RANK: r}) for r in range(6)}
    send_straggler_steps(exporters, range(30, 60), t0, slow_rank=None)  # the straggler recovers: its alert resolves
    wait_until(lambda: alerts_pending(collector) >= 2, "the resolution was never queued")
    receiver = WebhookReceiver(port, SECRET).start()
    try:
        receiver.wait_for(2)
        wait_until(lambda: alerts_pending(collector) == 0, "alerts still pending")
        time.sleep(1.0)  # nothing comes twice
    finally:
        receiver.stop()
    collector.stop()
    ids = [d.webhook_id for d in receiver.deliveries]
    assert len(ids) == len(set(ids)) == 2 and all(d.verified for d in receiver.deliveries)
    fired, resolved = (d.body["alerts"] for d in receiver.deliveries)
    assert [(a["status"], a["labels"]["ranks"]) for a in fired + resolved] == [("firing", "2"), ("resolved", "2")], [
        d.body for d in receiver.deliveries
    ]
    assert fired[0]["fingerprint"] == resolved[0]["fingerprint"]
    assert query(collector.db, "SELECT webhook_id, state FROM outbox ORDER BY id") == [(i, "delivered") for i in ids]
    findings = query(
        collector.db,
        "SELECT state, analyzer, ranks, step_start, step_end, summary FROM findings WHERE run_id = 'run-alerts'",
    )
    # every finding of the run is the straggler's and none is left firing (on a loaded machine its episode
    # can be drawn as two findings across the restart, the second raising no alert of its own)
    assert {(state, analyzer, tuple(ranks)) for state, analyzer, ranks, *_ in findings} == {
        ("resolved", "stragglers", (2,))
    }, findings


def test_alerts_test_command_sends_a_signed_v4_alert(tmp_path):
    receiver = WebhookReceiver(free_port(), SECRET).start()
    try:
        result = rankwatch_cli(
            "alerts", "test", "--url", receiver.url, "--secret", SECRET, "--db", str(tmp_path / "rw.duckdb")
        )
    finally:
        receiver.stop()
    label = default_name(receiver.url)  # not the URL, a secret
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{label}: delivered (HTTP 200)\n", "")
    (delivery,) = receiver.deliveries
    assert delivery.verified and delivery.body["version"] == "4"
    assert delivery.body["alerts"][0]["labels"]["alertname"] == "RankwatchTest"


def test_alerts_test_command_reports_each_configured_receiver(tmp_path):
    good, bad = WebhookReceiver(free_port(), SECRET).start(), WebhookReceiver(free_port(), status=500).start()
    (tmp_path / "alerts.toml").write_text(
        f'[[receivers]]\nname = "good"\nurl = "{good.url}"\nsecret = "{SECRET}"\n'
        f'[[receivers]]\nname = "bad"\nurl = "{bad.url}"\n'
    )
    try:
        result = rankwatch_cli("alerts", "test", "--db", str(tmp_path / "rw.duckdb"))
    finally:
        good.stop()
        bad.stop()
    assert result.returncode == 2
    assert result.stdout == "good: delivered (HTTP 200)\nbad: failed: HTTP 500\n"
    assert result.stderr == "rankwatch: error: the test alert did not reach 1 of 2 receivers: bad\n"
    assert good.deliveries[0].verified and bad.deliveries[0].verified is None  # bad has no secret: unsigned

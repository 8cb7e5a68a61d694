"""The collector's own health: the analyzer on small snapshots, and a real collector that refuses
a job's exports (wrong token) paging a real receiver with a signed alert."""

import json
import math
import time

from collector.analysis.analyzers import health
from tests.support import loopback
from tests.support.collectors import free_port
from tests.support.otlp_payloads import query, step_spans, trace_body
from tests.support.webhook_receiver import Receiver

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
NO_OUTBOX: list[health.Waiting] = []
BUCKETS = (0.01, 0.1, 1.0, 2.5, math.inf)
MIB = 2**20


def snapshot(
    at: float = 0.0,
    requests: dict | None = None,
    queue_bytes: int = 0,
    commits: tuple = (0,) * 5,
    failures: dict | None = None,
) -> health.Snapshot:
    return health.Snapshot(at, requests or {}, queue_bytes, 1000 * MIB, dict(zip(BUCKETS, commits)), failures or {})


def kinds(found) -> dict[str, tuple[str, str]]:
    return {f.kind: (f.severity, f.summary) for f in found}


def test_a_healthy_collector_has_no_findings():
    first = snapshot(0, {200: 100}, commits=(50, 90, 100, 100, 100))
    last = snapshot(60, {200: 200, 503: 1}, queue_bytes=500 * MIB, commits=(100, 190, 200, 200, 200))
    assert health.analyze(first, last, NO_OUTBOX) == []


def test_refused_exports_by_share_with_401_critical():
    first = snapshot(0, {200: 100})
    found = kinds(health.analyze(first, snapshot(120, {200: 180, 503: 10, 400: 10}), NO_OUTBOX))
    assert found == {
        "refused_exports": ("warning", ("20% of 100 OTLP exports refused in the last 2 min (10 x 400, 10 x 503)"))
    }
    severity, summary = kinds(health.analyze(first, snapshot(60, {200: 180, 401: 20}), NO_OUTBOX))["refused_exports"]
    assert severity == "critical" and summary.endswith("a job sends the wrong token and loses its telemetry")
    # too few exports in the window to judge a rate
    assert health.analyze(snapshot(0, {200: 5}), snapshot(60, {200: 10, 401: 5}), NO_OUTBOX) == []


def test_queue_filling_slow_commits_and_failing_analysis():
    first = snapshot(0, commits=(100, 100, 100, 100, 100), failures={"hangs": 3, "power": 1})
    last = snapshot(
        30, queue_bytes=900 * MIB, commits=(100, 150, 190, 200, 200), failures={"hangs": 5, "power": 1}
    )  # 10 of 100 commits > 1 s
    too_few = snapshot(30, commits=(100, 140, 190, 199, 199))  # 99 commits in the window
    assert health.analyze(first, too_few, NO_OUTBOX) == []
    found = kinds(health.analyze(first, last, NO_OUTBOX))
    assert found == {
        "queue_filling": (
            "warning",
            ("the write queue is 90% full (900 of 1000 MiB): exports will be refused with 503 next"),
        ),
        "slow_commits": (
            "warning",
            ("99% of group commits took up to 2.5 s in the last 30 s: telemetry and findings are late"),
        ),
        "analysis_failing": (
            "warning",
            (
                "analysis failed in the last 30 s: hangs 2 time(s); "
                "findings may be missing (the collector's log says why)"
            ),
        ),
    }


def test_alerts_waiting_too_long_name_their_receivers():
    outbox = [health.Waiting("slack", 3, 1200.0), health.Waiting("oncall", 1, 3600.0), health.Waiting("fresh", 4, 30.0)]
    (finding,) = health.analyze(snapshot(0), snapshot(60), outbox)
    assert (finding.kind, finding.run_id, finding.ranks) == ("alerts_undelivered", "", [])
    assert finding.summary == (
        "alert notifications wait for receiver oncall (1, the oldest for 60 min), "
        "receiver slack (3, the oldest for 20 min)"
    )


def test_a_collector_refusing_a_job_pages_the_receiver(collector_factory, tmp_path):
    receiver = Receiver(free_port(), SECRET).start()
    alerts = tmp_path / "alerts.toml"
    alerts.write_text(
        f'[[receivers]]\nname = "oncall"\nurl = "{receiver.url}"\nsecret = "{SECRET}"\nseverities = ["critical"]\n'
    )
    try:
        collector = collector_factory(None, "--analyze-every", "0.5", "--alerts", str(alerts))
        wrong = {"Authorization": "Bearer wrong-token", "Content-Type": "application/x-protobuf"}
        for _ in range(health.Settings().min_requests):  # launchers checking a wrong token: nothing lost, no page
            checked = loopback.post(f"{collector.url}/v1/traces", content=b"", headers=wrong)
            assert checked.status_code == 401
        time.sleep(2)  # passes of the analysis judge the collector's health
        assert receiver.deliveries == []
        spans = trace_body(step_spans("run-refused", 0, [0]))
        for _ in range(health.Settings().min_requests):  # a job's exports of spans refused: they are lost
            response = loopback.post(f"{collector.url}/v1/traces", content=spans, headers=wrong)
            assert response.status_code == 401
        (delivery,) = receiver.wait_for(1)
    finally:
        receiver.stop()
    collector.stop()
    assert delivery.verified
    (alert,) = delivery.body["alerts"]
    assert alert["status"] == "firing"
    assert alert["labels"] == {
        "alertname": "RankwatchCollector",
        "analyzer": "collector",
        "kind": "refused_exports",
        "severity": "critical",
        "ranks": "none",
    }  # no run: it is the collector's own
    assert alert["annotations"]["summary"].startswith("100% of 20 OTLP exports refused in the last ")
    assert alert["annotations"]["dashboard"] == "http://127.0.0.1:8501/"
    ((run_id, state, evidence),) = query(collector.db, "SELECT run_id, state, evidence FROM findings")
    assert (run_id, state, json.loads(evidence)["refused"]) == ("", "firing", {"401": 20})

"""The control API and automatic rollback commands, on a real collector.

Covered: a run whose loss turns NaN gets exactly one rollback command from the
anomaly analyzer, however many analysis passes follow; the job moves it to
acked and applied through the API; once applied, the steps it abandoned leave
`current_steps` and the anomaly resolves when the replayed steps are sane.
The API refuses a missing token (401), bad bodies and states (400), unknown
commands (404), and going back from applied; people can create commands.
"""

import math
import time

import httpx
import pytest

from agent import semconv as sc
from agent.export import Exporter
from tests.conftest import wait_until
from tests.otlp_payloads import query

RUN, RANKS, MS = "run-control", 4, 1_000_000


def send_steps(exporter_by_rank, steps, t0, nan_from=None):
    """Step spans of every rank: a falling loss, NaN from step `nan_from` on."""
    for step in steps:
        for exporter in exporter_by_rank.values():
            loss = math.nan if nan_from is not None and step >= nan_from else 3 + 5 * math.exp(-step / 10)
            start = t0 + step * 100 * MS
            exporter.trace([("step", start, start + 100 * MS, {
                sc.KIND: sc.KIND_STEP, sc.STEP: step, sc.LOSS: loss, sc.GRAD_NORM: 1.0, sc.COMPUTE_S: 0.08,
                sc.COMM_WAIT_S: 0.01})])
    for exporter in exporter_by_rank.values():
        wait_until(exporter.flush, "steps not delivered", 120)  # a loaded machine may time an export out


def commands(client, **params):
    response = client.get("/v1/commands", params={"run_id": RUN, **params})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def client(collector_factory):
    collector = collector_factory(None, "--analyze-every", "0.5")
    with httpx.Client(base_url=collector.url, headers={"Authorization": f"Bearer {collector.token}"},
                      timeout=10) as http:
        http.collector = collector
        yield http


def test_nan_gets_one_rollback_that_the_job_applies(client):
    collector = client.collector
    exporters = {r: Exporter(collector.url, collector.token, {sc.RUN_ID: RUN, sc.RANK: r}) for r in range(RANKS)}
    t0 = time.time_ns() - 60_000 * MS
    send_steps(exporters, range(40), t0, nan_from=30)
    wait_until(lambda: commands(client), "no rollback command")
    pending = commands(client)
    time.sleep(2)  # several more analysis passes: still one command for the one anomaly
    (command,) = commands(client)
    assert command == pending[0]
    assert (command["kind"], command["state"], command["created_by"]) == ("rollback", "pending", "anomalies")
    assert command["args"] == {"before_step": 25, "anomaly": "nan", "skip_batches": 20, "lr_scale": 1.0}

    acked = client.post(f"/v1/commands/{command['id']}", json={"state": "acked", "apply_step": 41})
    assert acked.status_code == 200 and acked.json()["apply_step"] == 41
    resumed_ns = t0 + 45 * 100 * MS
    applied = client.post(f"/v1/commands/{command['id']}", json={
        "state": "applied", "result": {"restored_step": 24, "resumed_ns": resumed_ns, "skipped_batches": 20}})
    assert applied.json()["state"] == "applied" and applied.json()["result"]["restored_step"] == 24
    # restored to step 24 (24 steps done), the job replays steps 24..39 after resuming, with a sane loss
    send_steps(exporters, range(24, 40), t0 + 21 * 100 * MS)
    time.sleep(2)
    back = client.post(f"/v1/commands/{command['id']}", json={"state": "pending"})
    assert back.status_code == 400 and "already applied" in back.json()["error"]
    for exporter in exporters.values():
        exporter.shutdown()
    collector.stop()

    assert query(collector.db, "SELECT count(*), count(DISTINCT (rank, step)) FROM current_steps WHERE run_id = ?",
                 [RUN]) == [(40 * RANKS, 40 * RANKS)]
    assert query(collector.db, "SELECT count(*) FROM current_steps WHERE run_id = ? AND isnan(loss)", [RUN]) == [(0,)]
    assert query(collector.db, "SELECT count(*) FROM steps WHERE run_id = ?", [RUN]) == [(56 * RANKS,)]
    assert query(collector.db, "SELECT kind, state FROM findings WHERE run_id = ? AND analyzer = 'anomalies'",
                 [RUN]) == [("nan", "resolved")]
    assert query(collector.db, "SELECT count(*) FROM commands") == [(1,)]


def test_a_person_creates_a_command(client):
    created = client.post("/v1/commands", json={"run_id": RUN, "kind": "rollback", "args": {"before_step": 7}})
    assert created.status_code == 201
    assert (created.json()["created_by"], created.json()["args"]) == ("api", {"before_step": 7})
    assert [c["id"] for c in commands(client, state="pending")] == [created.json()["id"]]
    assert commands(client, state="applied") == []


@pytest.mark.parametrize("method, path, body, status, why", [
    ("post", "/v1/commands", b"not json", 400, "not JSON"),
    ("post", "/v1/commands", b'{"run_id": "r"}', 400, "with run_id, kind"),
    ("post", "/v1/commands", b'{"run_id": "r", "kind": "reboot"}', 400, "unknown command kind 'reboot'"),
    ("post", "/v1/commands/999", b'{"state": "applied"}', 404, "no command 999"),
    ("post", "/v1/commands/x", b'{"state": "applied"}', 400, "command ids are integers"),
    ("get", "/v1/commands", None, 400, "run_id is required"),
])
def test_bad_requests_are_refused(client, method, path, body, status, why):
    response = client.request(method.upper(), path, content=body)
    assert response.status_code == status and why in response.json()["error"], response.text


def test_bad_state_is_refused(client):
    created = client.post("/v1/commands", json={"run_id": RUN, "kind": "rollback", "args": {"before_step": 3}}).json()
    response = client.post(f"/v1/commands/{created['id']}", json={"state": "done"})
    assert response.status_code == 400 and "unknown state 'done'" in response.json()["error"]


def test_the_token_is_required(client):
    for request in (httpx.Request("GET", f"{client.collector.url}/v1/commands", params={"run_id": RUN}),
                    httpx.Request("POST", f"{client.collector.url}/v1/commands", json={"run_id": RUN,
                                                                                        "kind": "rollback"})):
        assert httpx.Client().send(request).status_code == 401


def test_one_anomaly_seen_twice_gets_one_rollback_even_when_it_fails():
    """A loss spike and its gradient-norm spike are one anomaly: one rollback answers both, and its
    failure (the job stopped) does not send another; the anomaly coming back later does."""
    import duckdb

    from collector import commands, findings
    from collector.analyzers import Finding
    from collector.store.schema import DDL

    con = duckdb.connect()
    con.execute(DDL)

    def spike(kind: str) -> Finding:
        return Finding("r", kind, [0], 120, 120, "critical", 9.0, f"{kind} at 120", analyzer="anomalies")

    findings.record(con, "r", "anomalies", [spike("loss_spike"), spike("grad_spike")])
    (sent,) = commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy())
    assert sent["args"]["before_step"] == 115
    commands.update(con, sent["id"], "failed", result={"why": "budget spent"})
    assert commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy()) == []
    findings.record(con, "r", "anomalies", [])  # resolved: the job went back
    findings.record(con, "r", "anomalies", [spike("loss_spike")])  # and spiked at 120 again
    (again,) = commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy())
    assert again["id"] != sent["id"]


def test_a_gradient_norm_spike_alone_is_rolled_back_only_when_asked():
    import duckdb

    from collector import commands, findings
    from collector.analyzers import Finding
    from collector.store.schema import DDL

    con = duckdb.connect()
    con.execute(DDL)
    findings.record(con, "r", "anomalies", [Finding("r", "grad_spike", [], 77, 77, "warning", 10.3, "grad at 77",
                                                    analyzer="anomalies")])
    assert commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy()) == []
    asked = commands.RollbackPolicy(on=commands.ROLLBACK_ON | {"grad_spike"})
    (sent,) = commands.rollbacks_for_anomalies(con, "r", asked)
    assert (sent["args"]["anomaly"], sent["args"]["before_step"]) == ("grad_spike", 72)

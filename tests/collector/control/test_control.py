"""The control API and automatic rollback commands, on a real collector.

Covered: a run whose loss turns NaN gets exactly one rollback command from the
anomaly analyzer, however many analysis passes follow; the job moves it to
acked and applied through the API; once applied, the steps it abandoned leave
`current_steps` and the anomaly resolves when the replayed steps are sane.
The API refuses a missing token (401), bad bodies and states (400), unknown
commands (404), and going back from applied; people can create commands.
"""

import math
import socket
import threading
import time

import httpx
import pytest

from collector.control.api import MAX_WAITING
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until

pytestmark = pytest.mark.long

RUN, RANKS, MS = "run-control", 4, 1_000_000


def send_steps(exporter_by_rank, steps, t0, nan_from=None):
    """Step spans of every rank: a falling loss, NaN from step `nan_from` on."""
    for step in steps:
        for exporter in exporter_by_rank.values():
            loss = math.nan if nan_from is not None and step >= nan_from else 3 + 5 * math.exp(-step / 10)
            start = t0 + step * 100 * MS
            exporter.trace(
                [
                    (
                        "step",
                        start,
                        start + 100 * MS,
                        {
                            sc.KIND: sc.KIND_STEP,
                            sc.STEP: step,
                            sc.LOSS: loss,
                            sc.GRAD_NORM: 1.0,
                            sc.COMPUTE_S: 0.08,
                            sc.COMM_WAIT_S: 0.01,
                        },
                    )
                ]
            )
    for exporter in exporter_by_rank.values():
        wait_until(exporter.flush, "steps not delivered", 120)  # a loaded machine may time an export out


def commands(client, **params):
    response = client.get("/v1/commands", params={"run_id": RUN, **params})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def client(collector_factory):
    collector = collector_factory(None, "--analyze-every", "0.5")
    with loopback.Client(
        base_url=collector.url, headers={"Authorization": f"Bearer {collector.token}"}, timeout=10
    ) as http:
        http.collector = collector
        yield http


@pytest.fixture(scope="module")
def refusing(module_collector):
    """A client of one collector for the module's refused requests: a refusal changes nothing, so they share it."""
    with loopback.Client(base_url=module_collector.url, headers=module_collector.headers, timeout=10) as http:
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
    applied = client.post(
        f"/v1/commands/{command['id']}",
        json={"state": "applied", "result": {"restored_step": 24, "resumed_ns": resumed_ns, "skipped_batches": 20}},
    )
    assert applied.json()["state"] == "applied" and applied.json()["result"]["restored_step"] == 24
    # restored to step 24 (24 steps done), the job replays steps 24..39 after resuming, with a sane loss
    send_steps(exporters, range(24, 40), t0 + 21 * 100 * MS)
    time.sleep(2)
    back = client.post(f"/v1/commands/{command['id']}", json={"state": "pending"})
    assert back.status_code == 400 and "already applied" in back.json()["error"]
    for exporter in exporters.values():
        exporter.shutdown()
    collector.stop()

    assert query(
        collector.db, "SELECT count(*), count(DISTINCT (rank, step)) FROM current_steps WHERE run_id = ?", [RUN]
    ) == [(40 * RANKS, 40 * RANKS)]
    assert query(collector.db, "SELECT count(*) FROM current_steps WHERE run_id = ? AND isnan(loss)", [RUN]) == [(0,)]
    assert query(collector.db, "SELECT count(*) FROM steps WHERE run_id = ?", [RUN]) == [(56 * RANKS,)]
    assert query(
        collector.db, "SELECT kind, state FROM findings WHERE run_id = ? AND analyzer = 'anomalies'", [RUN]
    ) == [("nan", "resolved")]
    assert query(collector.db, "SELECT count(*) FROM commands") == [(1,)]


def test_a_person_creates_a_command(client):
    created = client.post("/v1/commands", json={"run_id": RUN, "kind": "rollback", "args": {"before_step": 7}})
    assert created.status_code == 201
    assert (created.json()["created_by"], created.json()["args"]) == ("api", {"before_step": 7})
    assert [c["id"] for c in commands(client, state="pending")] == [created.json()["id"]]
    assert commands(client, state="applied") == []


@pytest.mark.parametrize(
    "method, path, body, status, why",
    [
        ("post", "/v1/commands", b"not json", 400, "not JSON"),
        ("post", "/v1/commands", b'{"run_id": "r"}', 400, "with run_id, kind"),
        ("post", "/v1/commands", b'{"run_id": "r", "kind": "reboot"}', 400, "unknown command kind 'reboot'"),
        ("post", "/v1/commands/999", b'{"state": "applied"}', 404, "no command 999"),
        ("post", "/v1/commands/x", b'{"state": "applied"}', 400, "command ids are integers"),
        ("get", "/v1/commands", None, 400, "run_id is required"),
        (
            "get",
            f"/v1/commands?run_id={RUN}&state=pending&wait=31",
            None,
            400,
            "wait must be a number of seconds in [0, 30]",
        ),
        ("get", f"/v1/commands?run_id={RUN}&state=pending&wait=1e999", None, 400, "wait must be a number"),
        ("get", f"/v1/commands?run_id={RUN}&state=pending&wait=nan", None, 400, "wait must be a number"),
        ("get", f"/v1/commands?run_id={RUN}&state=pending&wait=-1", None, 400, "wait must be a number"),
        ("get", f"/v1/commands?run_id={RUN}&wait=1", None, 400, "it takes state=pending"),
    ],
)
def test_bad_requests_are_refused(refusing, method, path, body, status, why):
    response = refusing.request(method.upper(), path, content=body)
    assert response.status_code == status and why in response.json()["error"], response.text


def test_bad_state_is_refused(client):
    created = client.post("/v1/commands", json={"run_id": RUN, "kind": "rollback", "args": {"before_step": 3}}).json()
    response = client.post(f"/v1/commands/{created['id']}", json={"state": "done"})
    assert response.status_code == 400 and "unknown state 'done'" in response.json()["error"]


def test_the_token_is_required(client):
    for request in (
        httpx.Request("GET", f"{client.collector.url}/v1/commands", params={"run_id": RUN}),
        httpx.Request("POST", f"{client.collector.url}/v1/commands", json={"run_id": RUN, "kind": "rollback"}),
    ):
        assert loopback.Client().send(request).status_code == 401


def test_a_held_poll_answers_as_soon_as_a_command_is_queued(client):
    """A poll held for 20 s answers with the command created meanwhile well within the agent's
    plain poll interval (2 s), the held polls being asked about every 50 ms."""
    held: list = []
    poll = threading.Thread(
        target=lambda: held.append(
            client.get("/v1/commands", params={"run_id": RUN, "state": "pending", "wait": 20}, timeout=30)
        )
    )
    poll.start()
    time.sleep(0.5)  # the poll is held by now (were it not, it would be answered at once, empty: the test fails)
    created = client.post("/v1/commands", json={"run_id": RUN, "kind": "rollback", "args": {"before_step": 7}})
    queued = time.monotonic()
    poll.join(30)
    answered = time.monotonic() - queued
    assert held[0].status_code == 200 and [c["id"] for c in held[0].json()] == [created.json()["id"]]
    assert answered < 1.5, answered


def test_an_idle_held_poll_ends_at_its_wait_and_needs_the_token(client):
    started = time.monotonic()
    idle = client.get("/v1/commands", params={"run_id": RUN, "state": "pending", "wait": 1.5})
    assert idle.status_code == 200 and idle.json() == [] and time.monotonic() - started >= 1.5
    unauthorized = loopback.get(
        f"{client.collector.url}/v1/commands", params={"run_id": RUN, "state": "pending", "wait": 20}, timeout=10
    )
    assert unauthorized.status_code == 401  # at once, never held


def test_held_polls_are_bounded_in_number(client):
    """MAX_WAITING polls held at once: a poll beyond them is answered at once, empty, as without
    `wait`, while those held stay held."""
    url = httpx.URL(client.collector.url)
    request = (
        f"GET /v1/commands?run_id={RUN}&state=pending&wait=30 HTTP/1.1\r\nHost: {url.host}\r\n"
        f"Authorization: Bearer {client.collector.token}\r\n\r\n"
    ).encode()
    held = []
    try:
        for _ in range(MAX_WAITING):
            held.append(socket.create_connection((url.host, url.port)))
            held[-1].sendall(request)

        def answered_at_once() -> bool:  # a probe that is held counts too: it stays held once it times out
            try:
                return (
                    client.get("/v1/commands", params={"run_id": RUN, "state": "pending", "wait": 30}, timeout=3).json()
                    == []
                )
            except httpx.TimeoutException:
                return False

        wait_until(answered_at_once, "no poll was answered at once past the bound", 120)
        for connection in held:
            connection.setblocking(False)
        assert all(_unanswered(connection) for connection in held)
    finally:
        for connection in held:
            connection.close()


def _unanswered(connection: socket.socket) -> bool:
    """Nothing came back on the connection yet (neither an answer nor its end)."""
    try:
        connection.recv(1)
    except BlockingIOError:
        return True
    return False


def test_a_spike_seen_with_its_clean_steps_after_it_is_still_rolled_back():
    """At a fast step rate one export brings a loss spike and more clean steps after it than an
    anomaly stays firing for: the pass that draws it resolves it at once, and it still gets its
    rollback (a spike at 200 seen with steps up to 245: none was sent)."""
    import duckdb

    from collector.analysis import findings
    from collector.analysis.analyzers import Finding, anomalies
    from collector.control import commands
    from collector.store.schema import DDL

    con = duckdb.connect()
    con.execute(DDL)
    spike = Finding("r", "loss_spike", [], 200, 200, "critical", 60.0, "loss at 200", analyzer="anomalies")
    findings.record_pass(con, "r", {"anomalies": [spike]}, {"anomalies": anomalies.READS}, last=245)
    assert con.execute("SELECT state FROM findings").fetchall() == [("resolved",)]
    (sent,) = commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy())
    assert sent["args"]["before_step"] == 195
    findings.record_pass(con, "r", {"anomalies": []}, {"anomalies": anomalies.READS}, last=260)
    commands.update(con, sent["id"], "applied", result={"restored_step": 190})
    assert commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy()) == []  # answered once


def test_one_anomaly_seen_twice_gets_one_rollback_even_when_it_fails():
    """A loss spike and its gradient-norm spike are one anomaly: one rollback answers both, and its
    failure (the job stopped) does not send another; the anomaly coming back later does."""
    import duckdb

    from collector.analysis import findings
    from collector.analysis.analyzers import Finding
    from collector.control import commands
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

    from collector.analysis import findings
    from collector.analysis.analyzers import Finding
    from collector.control import commands
    from collector.store.schema import DDL

    con = duckdb.connect()
    con.execute(DDL)
    findings.record(
        con,
        "r",
        "anomalies",
        [Finding("r", "grad_spike", [], 77, 77, "warning", 10.3, "grad at 77", analyzer="anomalies")],
    )
    assert commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy()) == []
    asked = commands.RollbackPolicy(on=commands.ROLLBACK_ON | {"grad_spike"})
    (sent,) = commands.rollbacks_for_anomalies(con, "r", asked)
    assert (sent["args"]["anomaly"], sent["args"]["before_step"]) == ("grad_spike", 72)

"""The control API under hostile or broken requests, on a real collector on loopback.

Covered: the token is checked before the body is read (a wrong token gets 401
even while the body is still on its way, and a huge unauthenticated body costs
the server no memory); bodies are capped (413, read as a stream); non-finite
numbers, deep nesting, out-of-range or mistyped fields get 400 with one line;
a stored row that cannot be sent as JSON does not break polling for its run;
the agent logs a poll that fails, once per kind of failure. A command out of
the range a job can sanely act on (a rollback that raises the learning rate a
thousandfold or skips 2^40 batches, a power cap of 1 W) is refused 400. A token
scoped to ingest, query or control (`rankwatch token --scope`) makes only the
requests its scope covers, and gets 403 for the others: an ingest token, the
one a job holds, exports and polls and acks its commands, but neither posts
commands nor queries. Then hypothesis
posts random bodies and tokens: never a 5xx, never a hang, and a valid
command still goes round (create, poll, ack) afterwards.
"""

import json
import logging
import socket
import time
from pathlib import Path

import duckdb
import httpx
import pytest
from google.rpc.status_pb2 import Status
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from collector.control.api import MAX_BODY, MAX_DEPTH, MAX_WAITING
from rankwatch.agent.commands import Commands
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.commands import rankwatch_in_process
from tests.support.waits import wait_until

RUN = "run-abuse-control"
ANSWER_S = 10  # every request is answered within this, on a loaded machine


@pytest.fixture(scope="module")
def collector(module_collector):
    return module_collector


@pytest.fixture
def client(collector):
    with loopback.Client(base_url=collector.url, headers=collector.headers, timeout=ANSWER_S) as http:
        yield http


@pytest.fixture
def anonymous(collector):
    """A client that sends only the headers each request names."""
    with loopback.Client(base_url=collector.url, timeout=ANSWER_S) as http:
        yield http


def authorization(header: str | None) -> dict[str, str]:
    return {"Authorization": header} if header is not None else {}


def peak_rss(pid: int) -> int:
    """The most resident memory the process has held."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def chunks(total: int, size: int = 1 << 20):
    """`total` bytes of a JSON-looking body, generated as it is sent (the client holds one chunk)."""
    chunk = b"[" * size
    for _ in range(total // size):
        yield chunk


def create(client, **fields) -> httpx.Response:
    """POST a command: a rollback unless `fields` say otherwise (sent as ASCII JSON, lone surrogates escaped)."""
    body = {"run_id": RUN, "kind": "rollback", "args": {"before_step": 5}} | fields
    return client.post("/v1/commands", content=json.dumps(body).encode())


def round_trip(client) -> None:
    """A valid command goes round: created, polled as pending, acked, applied."""
    created = create(client)
    assert created.status_code == 201, created.text
    pending = client.get("/v1/commands", params={"run_id": RUN, "state": "pending"})
    assert pending.status_code == 200, pending.text
    assert created.json()["id"] in [c["id"] for c in pending.json()]
    acked = client.post(f"/v1/commands/{created.json()['id']}", json={"state": "acked", "apply_step": 12})
    assert acked.status_code == 200 and acked.json()["apply_step"] == 12, acked.text
    applied = client.post(f"/v1/commands/{created.json()['id']}", json={"state": "applied", "result": {"ok": 1}})
    assert applied.status_code == 200 and applied.json()["result"] == {"ok": 1}, applied.text


def refused(response: httpx.Response, status: int = 400) -> str:
    """The one-line reason of a refusal with `status`."""
    assert response.status_code == status, (response.status_code, response.text)
    reason = response.json()["error"]
    assert reason and "\n" not in reason
    return reason


# --- the token first, the body capped


def test_a_wrong_token_is_answered_before_the_body_arrives(collector):
    """401 while the body is still being sent: nothing of it was read, let alone parsed."""
    with socket.create_connection(("127.0.0.1", collector.port), timeout=ANSWER_S) as s:
        s.sendall(
            b"POST /v1/commands HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"run_id": '
        )
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}])
@pytest.mark.parametrize("path", ["/v1/commands", "/v1/commands/1", "/v1/commands/x"])
def test_a_malformed_body_without_the_token_gets_401(anonymous, headers, path):
    response = anonymous.post(path, content=b"{not json", headers=headers)
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"


def test_a_huge_unauthenticated_body_costs_no_memory(collector, anonymous):
    before = peak_rss(collector.process.pid)
    response = anonymous.post("/v1/commands", content=chunks(128 << 20), timeout=60)
    assert response.status_code == 401
    assert peak_rss(collector.process.pid) - before < 64 << 20


def test_a_huge_body_is_refused_as_too_large_without_being_held(collector, client):
    before = peak_rss(collector.process.pid)
    response = client.post("/v1/commands", content=chunks(128 << 20), timeout=60)  # streamed: no Content-Length
    assert f"{MAX_BODY} bytes" in refused(response, 413)
    assert peak_rss(collector.process.pid) - before < 64 << 20
    declared = client.post("/v1/commands", content=b"x" * (5 * MAX_BODY))  # refused on its Content-Length
    refused(declared, 413)
    round_trip(client)


# --- every field checked


@pytest.mark.parametrize(
    "body",
    [
        b'{"run_id": "r", "kind": "power_cap", "args": {"watts": 1e999}}',
        b'{"run_id": "r", "kind": "power_cap", "args": {"watts": Infinity}}',
        b'{"run_id": "r", "kind": "power_cap", "args": {"caps": {"0": NaN}}}',
        b'{"run_id": "r", "kind": "rollback", "args": {"before_step": 5, "lr_scale": -Infinity}}',
    ],
)
def test_non_finite_numbers_are_refused(client, body):
    assert "finite" in refused(client.post("/v1/commands", content=body))


def test_non_finite_numbers_in_a_result_are_refused(client):
    command = create(client).json()
    response = client.post(f"/v1/commands/{command['id']}", content=b'{"state": "failed", "result": {"x": 1e999}}')
    assert "finite" in refused(response)
    assert client.get("/v1/commands", params={"run_id": RUN}).status_code == 200


@pytest.mark.parametrize("field", ["args", "result"])
def test_deep_nesting_is_refused_promptly(client, field):
    deep = "[" * 500 + "]" * 500
    command = create(client).json()
    if field == "args":
        response = client.post("/v1/commands", content=f'{{"run_id": "r", "kind": "rollback", "args": {deep}}}')
    else:
        response = client.post(f"/v1/commands/{command['id']}", content=f'{{"state": "failed", "result": {deep}}}')
    assert f"deeper than {MAX_DEPTH}" in refused(response)
    very_deep = "[" * 30_000 + "]" * 30_000  # deeper than Python's recursion limit, within the size cap
    assert "deeper" in refused(client.post("/v1/commands", content=very_deep))


@pytest.mark.parametrize("apply_step", ["12", 2**70, -1, 2**40, {"step": 1}, [1], 1.5, True, 1e999])
def test_a_bad_apply_step_is_refused(client, apply_step):
    command = create(client).json()
    body = json.dumps({"state": "acked", "apply_step": apply_step}).encode()
    assert "apply_step" in refused(client.post(f"/v1/commands/{command['id']}", content=body))
    assert client.get("/v1/commands", params={"run_id": RUN, "state": "pending"}).status_code == 200


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"run_id": 7}, "run_id"),
        ({"run_id": ""}, "run_id"),
        ({"run_id": "r" * 1000}, "run_id"),
        ({"run_id": "\ud800"}, "UTF-8"),
        ({"kind": ["rollback"]}, "kind"),
        ({"kind": "reboot"}, "unknown command kind"),
        ({"args": [1, 2]}, "args"),
        ({"args": "before_step=5"}, "args"),
        ({"args": {}}, "before_step"),
        ({"args": {"before_step": "5"}}, "before_step"),
        ({"args": {"before_step": 2**70}}, "before_step"),
        ({"args": {"before_step": 5, "skip_batches": -1}}, "skip_batches"),
        ({"args": {"before_step": 5, "lr_scale": 0}}, "lr_scale"),
        ({"args": {"before_step": 5, "reboot": True}}, "reboot"),
        ({"args": {"before_step": 5, "anomaly": "x" * 1000}}, "anomaly"),
        ({"kind": "power_cap", "args": {"watts": 2**70}}, "watts"),
        ({"kind": "power_cap", "args": {"watts": 20_000}}, "power_cap"),
        ({"kind": "power_cap", "args": {"caps": {"-1": 300}}}, "power_cap"),
        ({"kind": "power_cap", "args": {"caps": {"x": 300}}}, "power_cap"),
        ({"kind": "power_cap", "args": {"caps": {"1" * 5000: 300}}}, "power_cap"),
        ({"kind": "power_cap", "args": {"watts": True}}, "power_cap"),
    ],
)
def test_a_bad_create_field_is_refused(client, fields, why):
    assert why in refused(create(client, **fields))


@pytest.mark.parametrize(
    "body, why",
    [
        ({"state": 3}, "state"),
        ({"state": "done"}, "unknown state"),
        ({"state": "failed", "result": [1]}, "result"),
        ({"state": "failed", "result": "oops"}, "result"),
        ({"state": "failed", "result": {"why": "\udfff"}}, "UTF-8"),
        ({"state": "failed", "extra": 1}, "extra"),
    ],
)
def test_a_bad_update_field_is_refused(client, body, why):
    command = create(client).json()
    assert why in refused(client.post(f"/v1/commands/{command['id']}", content=json.dumps(body).encode()))


@pytest.mark.parametrize("path", ["/v1/commands/x", "/v1/commands/99999999999999999999999", "/v1/commands/-1"])
def test_a_bad_command_id_is_refused(client, path):
    response = client.post(path, json={"state": "acked"})
    assert response.status_code in (400, 404) and response.json()["error"]


@pytest.mark.parametrize("params", [{"run_id": RUN, "state": "done"}, {"run_id": "r" * 1000}, {}])
def test_a_bad_listing_is_refused(client, params):
    refused(client.get("/v1/commands", params=params))


# --- commands a job could act on, but should not


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"args": {"before_step": 5, "lr_scale": 1000}}, "lr_scale"),  # the learning rate a thousandfold
        ({"args": {"before_step": 5, "lr_scale": 1.5}}, "lr_scale"),
        ({"args": {"before_step": 5, "lr_scale": 1e-9}}, "lr_scale"),  # training all but stopped
        ({"args": {"before_step": 5, "lr_scale": True}}, "lr_scale"),
        ({"args": {"before_step": 5, "skip_batches": 2**40 - 1}}, "skip_batches"),  # the data stream run past
        ({"args": {"before_step": 5, "skip_batches": 10**6}}, "skip_batches"),
        ({"args": {"before_step": 5, "skip_batches": True}}, "skip_batches"),
        ({"args": {"before_step": 5, "skip_batches": 2.0}}, "skip_batches"),
        ({"args": {"before_step": 2**40}}, "before_step"),
        ({"kind": "power_cap", "args": {"watts": 1}}, "watts"),  # every GPU of the job at its lowest limit
        ({"kind": "power_cap", "args": {"watts": 5000}}, "watts"),
        ({"kind": "power_cap", "args": {"caps": {"0": 300, "1": 1}}}, "watts"),
        ({"kind": "power_cap", "args": {"caps": {"16777216": 300}}}, "rank"),
    ],
)
def test_a_command_out_of_its_sane_range_is_refused(client, fields, why):
    assert why in refused(create(client, **fields))


def test_commands_at_the_ends_of_their_ranges_are_taken(client):
    from collector.control.commands import (
        MAX_LR_SCALE,
        MAX_SKIP_BATCHES,
        MAX_WATTS,
        MIN_LR_SCALE,
        MIN_WATTS,
    )

    for args in (
        {"before_step": 5, "lr_scale": MIN_LR_SCALE, "skip_batches": MAX_SKIP_BATCHES - 1},
        {"before_step": -5, "lr_scale": MAX_LR_SCALE, "skip_batches": 0},
    ):
        assert create(client, args=args).status_code == 201
    for args in ({"watts": MIN_WATTS}, {"caps": {"0": MAX_WATTS}}):
        assert create(client, kind="power_cap", args=args).status_code == 201


# --- tokens scoped to ingest, query or control


def scoped(collector, scope: str) -> str:
    """A token of `scope` alone, as `rankwatch token --scope` makes it from the collector's token."""
    made = rankwatch_in_process(
        "token", "--scope", scope, env={"RANKWATCH_TOKEN": collector.token, "RANKWATCH_TOKEN_FILE": ""}
    )
    assert made.returncode == 0 and made.stderr == "", made
    return made.stdout.strip()


def guarded(command_id: int) -> dict[str, tuple[str, str, bytes | None]]:
    """A request of each kind the collector's tokens guard, each one that the collector's own token
    gets a 2xx for: (method, path, body)."""
    return {
        "export": ("POST", "/v1/traces", b""),  # empty: agent.export.check_token's
        "poll": ("GET", f"/v1/commands?run_id={RUN}&state=pending", None),
        "ack": ("POST", f"/v1/commands/{command_id}", b'{"state": "acked", "apply_step": 3}'),
        "command": ("POST", "/v1/commands", json.dumps({"run_id": RUN, "kind": "power_cap", "args": {"watts": 300}})),
        "query": ("POST", "/api/v1/query", b'{"sql": "SELECT 1"}'),
    }


# What a token of each scope may do: a job's agents (ingest) export, poll their commands and ack them;
# a dashboard (query) reads; a person who commands (control) reads too, as `rankwatch power apply` does first.
MAY = {
    "ingest": {"export", "poll", "ack"},
    "query": {"poll", "query"},
    "control": {"poll", "query", "command", "ack"},
}
NEEDS = {"export": "ingest", "ack": "ingest or control", "query": "query", "command": "control"}  # as refusals say


@pytest.mark.parametrize("scope", sorted(MAY))
def test_a_scoped_token_makes_the_requests_its_scope_covers_and_gets_403_for_the_others(
    collector, client, anonymous, scope
):
    headers = {"Authorization": f"Bearer {scoped(collector, scope)}", "Content-Type": "application/json"}
    for name, (method, path, body) in guarded(create(client).json()["id"]).items():
        if name == "export":
            headers |= {"Content-Type": "application/x-protobuf"}
        response = anonymous.request(method, path, content=body, headers=headers)
        if name in MAY[scope]:
            assert response.is_success, (scope, name, response.status_code, response.text)
            continue
        assert response.status_code == 403, (scope, name, response.status_code, response.text)
        assert response.headers["WWW-Authenticate"].startswith('Bearer error="insufficient_scope"')
        if name == "export":  # OTLP's answer is a protobuf Status: PERMISSION_DENIED
            answer = Status.FromString(response.content)
            assert answer.code == 7 and "the ingest scope" in answer.message, answer
        else:
            assert f"the {NEEDS[name]} scope" in refused(response, 403)


def test_an_ingest_token_is_enough_for_the_agents_poll_and_ack(collector, client):
    """A job's agent holding only an ingest token fetches its run's command and acks it."""
    ingest = scoped(collector, "ingest")
    created = create(client, run_id=f"{RUN}-ingest").json()
    commands = Commands(collector.url, ingest, f"{RUN}-ingest", rank=0, poll_s=0.2, look_s=0)
    try:
        wait_until(lambda: commands.at_step(1), "the ingest token's poll fetched nothing")
    finally:
        commands.close()
    (acked,) = client.get("/v1/commands", params={"run_id": f"{RUN}-ingest"}).json()
    assert (acked["id"], acked["state"]) == (created["id"], "acked")


def test_a_scoped_token_of_another_collectors_token_is_refused_401(anonymous):
    from rankwatch.agent.config import scoped_token

    for scope in MAY:
        response = anonymous.get(
            "/v1/commands",
            params={"run_id": RUN},
            headers={"Authorization": f"Bearer {scoped_token('another-token-0123456', scope)}"},
        )
        assert refused(response, 401) == "missing or wrong bearer token"


def test_a_collector_refuses_a_scoped_token_as_its_own():
    """A scoped token given as the collector's own would make its holder every scope's tokens."""
    from collector.receive.auth import Tokens
    from rankwatch.agent.config import TokenError, scoped_token

    with pytest.raises(TokenError, match="scoped to ingest"):
        Tokens(scoped_token("test-token-0123456", "ingest"))


# --- a bad stored row


def test_a_stored_row_that_cannot_be_sent_does_not_break_polling(tmp_path):
    """Rows written before requests were checked (non-finite watts): the run's later commands still
    reach the job; the bad values read back as null."""
    with open(tmp_path / "collector.log", "w") as log:
        first = Collector(tmp_path / "rankwatch.duckdb", free_port(), "test-token-0123456", log=log).start()
        first.stop()
        with duckdb.connect(str(first.db)) as con:
            con.execute(
                "INSERT INTO commands (run_id, kind, args, created_by) VALUES (?, 'power_cap', "
                "'{\"watts\": Infinity}', 'api'), (?, 'power_cap', '{\"caps\": {\"0\": 1e999}}', 'api')",
                [RUN, RUN],
            )
        again = Collector(first.db, free_port(), "test-token-0123456", log=log).start()
        try:
            with loopback.Client(base_url=again.url, headers=again.headers, timeout=ANSWER_S) as client:
                pending = client.get("/v1/commands", params={"run_id": RUN, "state": "pending"})
                assert pending.status_code == 200, pending.text
                assert [c["args"] for c in pending.json()] == [{"watts": None}, {"caps": {"0": None}}]
                round_trip(client)
        finally:
            again.stop()


# --- the agent's side


def test_held_polls_of_clients_gone_free_their_slots(collector, client):
    """Clients hold every held-poll slot, then close their connections: a poll of a client still
    there is held again within a second or so (it waits for a command), not answered at once as
    while the slots are full."""
    run = f"{RUN}-held"
    request = (
        f"GET /v1/commands?run_id={run}&state=pending&wait=30 HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nAuthorization: Bearer {collector.token}\r\n\r\n"
    ).encode()

    def poll_s(wait_s: float = 2.0) -> float:
        started = time.monotonic()
        answer = client.get("/v1/commands", params={"run_id": run, "state": "pending", "wait": wait_s})
        assert answer.status_code == 200 and answer.json() == [], answer.text
        return time.monotonic() - started

    gone = [socket.create_connection(("127.0.0.1", collector.port)) for _ in range(MAX_WAITING)]
    try:
        for s in gone:
            s.sendall(request)
        wait_until(lambda: poll_s() < 1.0, "the polls of the clients to go never filled the slots")
    finally:
        for s in gone:
            s.close()
    closed = time.monotonic()
    wait_until(lambda: poll_s() > 1.5, "no slot came free")
    assert time.monotonic() - closed < 5  # a loaded machine: a slot is free within a second, the poll then held 2 s


def test_the_agent_logs_a_failing_poll_once(collector, caplog):
    caplog.set_level(logging.WARNING, "rankwatch.agent")
    wrong = Commands(collector.url, "wrong-token", RUN, rank=0, poll_s=0.05, look_s=0)
    try:
        wait_until(lambda: caplog.records, "the failing poll was not logged")
        time.sleep(1)  # many more polls, failing the same way
    finally:
        wrong.close()
    (record,) = caplog.records
    assert "401" in record.getMessage() and "bearer token" in record.getMessage()


# --- fuzzing

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)
field_names = st.sampled_from(
    [
        "run_id",
        "kind",
        "args",
        "state",
        "apply_step",
        "result",
        "caps",
        "watts",
        "before_step",
        "skip_batches",
        "lr_scale",
        "anomaly",
    ]
)
fields = st.dictionaries(
    field_names,
    st.one_of(
        json_values,
        st.sampled_from(
            ["rollback", "power_cap", "pending", "acked", "applied", "failed", "cancelled", RUN, 2**40, 2**70, -1]
        ),
    ),
    max_size=5,
)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda n, o, c: (o * n + c * n).encode(),
        st.integers(0, 5000),
        st.sampled_from(["[", '{"a":']),
        st.sampled_from(["]", "}"]),
    ),
    st.sampled_from(
        [
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b'{"args": {"watts": NaN}}',
            b"1e999",
            b"[1e999]",
            b'{"run_id": "r", "kind": "rollback", "args": {"before_step": -Infinity}}',
            b"",
            b"\xff\xfe",
            b'{"run_id": "\\ud800", "kind": "rollback", "args": {"before_step": 1}}',
            b'{"state": "\\udfff"}',
        ]
    ),
)
creates = st.sampled_from(
    [  # bodies the API takes: as they are, or with one field swapped for anything
        {
            "run_id": RUN,
            "kind": "rollback",
            "args": {"before_step": 5, "skip_batches": 2, "lr_scale": 0.5, "anomaly": "nan"},
        },
        {"run_id": RUN, "kind": "power_cap", "args": {"caps": {"0": 300.0, "3": 250}, "watts": 400}},
    ]
)
updates = st.sampled_from(
    [{"state": "acked", "apply_step": 3}, {"state": "failed", "result": {"why": "no checkpoint"}}]
)


def swapped(valid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` bodies, or those with one field, at the top or in args, swapped for any JSON value; as bytes."""
    return st.one_of(
        valid,
        st.builds(lambda body, name, value: body | {name: value}, valid, field_names, json_values),
        st.builds(
            lambda body, name, value: body | {"args": body.get("args", {}) | {name: value}},
            valid,
            field_names,
            json_values,
        ),
    ).map(lambda body: json.dumps(body).encode())


bodies = st.one_of(
    raw_bodies,
    fields.map(lambda value: json.dumps(value).encode()),
    json_values.map(lambda value: json.dumps(value).encode()),
)
ids = st.integers(1, 30).map(lambda i: f"/v1/commands/{i}")  # commands that exist, most of them
paths = st.one_of(
    st.just("/v1/commands"),
    ids,
    st.integers(-5, 2**70).map(lambda i: f"/v1/commands/{i}"),
    st.text("0123456789x-", min_size=1, max_size=30).map(lambda i: f"/v1/commands/{i}"),
)
requests = st.one_of(
    st.tuples(paths, bodies), st.tuples(st.just("/v1/commands"), swapped(creates)), st.tuples(ids, swapped(updates))
)
VALID = ("Bearer test-token-0123456", "bearer test-token-0123456")
headers = st.sampled_from(
    [*VALID, *VALID, "Bearer wrong", "Bearer", "Bearer test-token-0123456-2", "Basic dGVzdA==", None]
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(request=requests, header=headers)
def test_fuzzed_posts_are_never_a_server_error(anonymous, request, header):
    path, body = request
    response = anonymous.post(path, content=body, headers=authorization(header) | {"Content-Type": "application/json"})
    event(f"HTTP {response.status_code}")  # --hypothesis-show-statistics: how many got past the checks
    if header not in VALID:
        assert response.status_code == 401, response.text
    else:
        assert response.status_code < 500, response.text
        assert response.json()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    params=st.dictionaries(st.sampled_from(["run_id", "state", "x"]), st.text(max_size=300), max_size=3), header=headers
)
def test_fuzzed_listings_are_never_a_server_error(anonymous, params, header):
    response = anonymous.get("/v1/commands", params=params, headers=authorization(header))
    if header not in VALID:
        assert response.status_code == 401, response.text
    else:
        assert response.status_code < 500, response.text


def test_a_valid_command_still_goes_round_after_the_fuzzing(client, collector):
    round_trip(client)
    assert collector.process.poll() is None

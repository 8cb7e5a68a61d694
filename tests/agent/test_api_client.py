"""The client of the collector's JSON APIs (rankwatch/agent/apiclient.py), against a real collector on loopback,
and the one token check every guarded endpoint shares (collector/receive/auth.py).

Covered: JSON goes out and comes back as it was (text any Unicode, a query string that carries `&`
and `=`); a wrong or missing token is ApiError 401 with the API's reason; any other refusal
carries the API's reason and status; a collector not listening, one that never answers (the time
limit), and an answer that is not JSON are ApiErrors saying so in one line; a body JSON cannot
carry (NaN) is refused before anything is sent. Every endpoint behind the token refuses the same
requests with the same reason and challenge, OTLP and JSON alike."""

import socket
import time

import pytest
from google.rpc.status_pb2 import Status

from rankwatch.agent.apiclient import ApiClient, ApiError
from tests.support import loopback
from tests.support.collectors import free_port

RUN = "api client ü&state=applied"  # a query string built by hand would filter on state


def test_json_round_trip(module_collector):
    api = ApiClient(module_collector.url, module_collector.token)
    args = {"before_step": 7, "skip_batches": 3, "lr_scale": 0.5, "anomaly": "loss 🔥 spike"}
    created = api.post("/v1/commands", {"run_id": RUN, "kind": "rollback", "args": args})
    assert (created["run_id"], created["args"], created["state"]) == (RUN, args, "pending")
    assert [c["id"] for c in api.get("/v1/commands", {"run_id": RUN, "state": "pending"})] == [created["id"]]
    assert api.get("/v1/commands", {"run_id": "api client ü"}) == []


@pytest.mark.parametrize("token", ["wrong", None])
def test_a_wrong_or_missing_token_is_a_clear_error(module_collector, token):
    with pytest.raises(ApiError) as refused:
        ApiClient(module_collector.url, token).get("/v1/commands", {"run_id": RUN})
    assert (refused.value.status, refused.value.kind, str(refused.value)) == (
        401,
        "HTTP 401",
        "missing or wrong bearer token",
    )


def test_a_refusal_carries_the_apis_reason(module_collector):
    api = ApiClient(module_collector.url, module_collector.token)
    with pytest.raises(ApiError) as refused:
        api.post("/v1/commands", {"run_id": RUN, "kind": "reboot"})
    assert refused.value.status == 400 and str(refused.value).startswith("unknown command kind 'reboot'")
    with pytest.raises(ApiError) as missing:
        api.post("/v1/commands/999999", {"state": "applied"})
    assert missing.value.status == 404 and str(missing.value) == "no command 999999"


def test_an_answer_that_is_not_json_is_an_error(module_collector):
    with pytest.raises(ApiError) as not_json:
        ApiClient(module_collector.url, None).get("/metrics")  # Prometheus text
    assert not_json.value.status is None and "something other than JSON" in str(not_json.value)


def test_a_body_json_cannot_carry_is_refused_before_sending(module_collector):
    api = ApiClient(module_collector.url, module_collector.token)
    with pytest.raises(ApiError) as refused:
        api.post("/v1/commands", {"run_id": RUN, "kind": "rollback", "args": {"lr_scale": float("nan")}})
    assert refused.value.status is None and "as JSON" in str(refused.value)


def test_a_collector_not_listening_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ApiError) as down:
        ApiClient(url, "t").get("/healthz")
    assert down.value.status is None and down.value.kind == "ConnectionRefusedError"
    assert str(down.value).startswith(f"cannot reach the collector at {url}: ConnectionRefusedError")


def test_a_collector_that_never_answers_is_given_up_on_at_the_time_limit():
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        api = ApiClient(f"http://127.0.0.1:{silent.getsockname()[1]}", "t", timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises(ApiError) as stuck:
            api.get("/healthz")
        assert time.monotonic() - start < 30  # the time limit, not a hang (loaded machines are slow)
        assert stuck.value.status is None and stuck.value.kind == "TimeoutError"
        with pytest.raises(ApiError) as sooner:
            api.post("/v1/commands", {}, timeout_s=0.1)  # a call's own limit
        assert sooner.value.kind == "TimeoutError"


GUARDED = [
    ("post", "/v1/traces", "application/x-protobuf", b""),
    ("get", "/v1/commands?run_id=r", None, None),
    ("post", "/v1/commands", "application/json", b"{}"),
    ("post", "/api/v1/query", "application/json", b"{}"),
]


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", "Basic test-token-0123456", "test-token-0123456", "Bearer"]
)
def test_every_guarded_endpoint_refuses_alike(module_collector, authorization):
    for method, path, content_type, body in GUARDED:
        headers = {k: v for k, v in (("Authorization", authorization), ("Content-Type", content_type)) if v}
        r = loopback.request(method, module_collector.url + path, headers=headers, content=body, timeout=30)
        assert (r.status_code, r.headers["WWW-Authenticate"]) == (401, "Bearer"), (path, r.text)
        reason = Status.FromString(r.content).message if path == "/v1/traces" else r.json()["error"]
        assert reason == "missing or wrong bearer token", path

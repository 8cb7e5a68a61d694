"""Webhook receivers under abuse: none can kill or stall the alert delivery.

(a) A receiver that answers a gzip bomb (1 MB inflating to 1 GiB): the collector's memory stays
    bounded and later alerts still reach a good receiver. (b) A receiver that answers a byte at a
    time: each attempt ends at `timeout_s`, and SIGTERM stops the collector within about that.
(c) A URL the HTTP client cannot send to (`http://a..b/x`, whose empty label the resolver's IDNA
    encoding refuses) is refused by the receivers file's check in one line; one that gets past it
    fails its own deliveries alone, retried, while the other receivers get theirs.

The alerts are real: the collector's own health finding for refused exports (twenty of them, a
warning for a wrong content type, critical once a wrong token comes), posted to receivers on loopback.
"""

import signal
import subprocess
import time

import duckdb
import pytest

from collector.alerts.config import AlertConfig, Receiver
from collector.alerts.delivery import Delivery
from collector.alerts.outbox import Outbox
from collector.analysis import findings
from collector.analysis.analyzers import Finding, health
from collector.store.schema import DDL
from tests.support import loopback
from tests.support.collectors import free_port
from tests.support.commands import rankwatch_cli
from tests.support.floods import PeakRss
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until
from tests.support.webhook_receiver import GzipBomb, Trickler
from tests.support.webhook_receiver import Receiver as WebhookReceiver

pytestmark = pytest.mark.long

MiB = 2**20
TIMEOUT_S = 2  # the receivers' timeout_s
STOP_MARGIN_S = 20  # what a loaded machine may add to a stop (drain, checkpoint) beyond the attempt in flight
MEMORY_BOUND = 256 * MiB  # what the collector may grow by while the bomb is answered


def _alerts_file(tmp_path, *receivers: tuple[str, WebhookReceiver]) -> str:
    path = tmp_path / "alerts.toml"
    path.write_text(
        f"timeout_s = {TIMEOUT_S}\nbackoff_initial_s = 0.2\nbackoff_max_s = 1\n"
        + "".join(f'[[receivers]]\nname = "{name}"\nurl = "{r.url}"\n' for name, r in receivers)
    )
    return str(path)


def _refuse_exports(collector, headers: dict[str, str], status: int) -> None:
    """As many refused exports as the collector's health needs to judge a rate: a health alert."""
    for _ in range(health.Settings().min_requests):
        response = loopback.post(f"{collector.url}/v1/traces", content=b"{}", headers=headers, timeout=30)
        assert response.status_code == status


def test_a_gzip_bomb_answer_neither_grows_the_collector_nor_stops_later_alerts(collector_factory, tmp_path):
    bomb, good = GzipBomb(free_port()).start(), WebhookReceiver(free_port()).start()
    try:
        alerts = _alerts_file(tmp_path, ("bomb", bomb), ("good", good))
        collector = collector_factory(None, "--analyze-every", "0.5", "--alerts", alerts)
        with PeakRss(collector.process.pid) as rss:
            _refuse_exports(collector, {**collector.headers, "Content-Type": "text/plain"}, 415)  # a warning
            wait_until(lambda: bomb.deliveries and good.deliveries, "the warning did not reach both receivers", 60)
            _refuse_exports(collector, {"Authorization": "Bearer wrong-token"}, 401)  # critical: a later alert
            good.wait_for(2, 60)
            wait_until(lambda: len(bomb.deliveries) >= 2, "the bomb's receiver got no later alert", 60)
    finally:
        bomb.stop()
        good.stop()
    assert rss.peak - rss.start < MEMORY_BOUND, f"the collector grew by {(rss.peak - rss.start) / MiB:.0f} MiB"
    fired, escalated = good.deliveries[:2]
    assert [a["labels"]["severity"] for a in fired.body["alerts"]] == ["warning"]
    assert [(a["status"], a["labels"]["severity"]) for a in escalated.body["alerts"]] == [
        ("resolved", "warning"),
        ("firing", "critical"),
    ]


def test_a_trickling_receiver_is_cut_off_at_timeout_s_and_holds_no_stop(collector_factory, tmp_path):
    slow = Trickler(free_port()).start()
    try:
        collector = collector_factory(
            None, "--analyze-every", "0.5", "--alerts", _alerts_file(tmp_path, ("slow", slow))
        )
        _refuse_exports(collector, {"Authorization": "Bearer wrong-token"}, 401)
        wait_until(lambda: slow.deliveries, "the alert never reached the trickling receiver", 60)
        stopping = time.monotonic()
        collector.process.send_signal(signal.SIGTERM)
        try:
            status = collector.process.wait(timeout=TIMEOUT_S + STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            collector.process.kill()
            pytest.fail(f"SIGTERM held for more than {TIMEOUT_S + STOP_MARGIN_S} s by a receiver's answer")
        stopped_s = time.monotonic() - stopping
    finally:
        slow.stop()
    assert status in (0, -signal.SIGTERM), stopped_s  # drained and stopped (uvicorn re-raises the signal)
    ((state, attempts, error),) = query(collector.db, "SELECT state, attempts, last_error FROM outbox")
    assert (state, error) == ("pending", f"no answer within {TIMEOUT_S} s") and attempts >= 1


def test_a_url_the_client_cannot_send_to_is_refused_in_one_line(tmp_path):
    alerts = tmp_path / "alerts.toml"
    alerts.write_text('[[receivers]]\nname = "typo"\nurl = "http://a..b/x"\n')
    result = rankwatch_cli("alerts", "test", "--alerts", str(alerts), "--db", str(tmp_path / "rw.duckdb"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"rankwatch: error: {alerts}: receiver 1: url") and result.stderr.count("\n") == 1


@pytest.mark.parametrize("url", ["http://a..b/x", "http://é..b/x", "http://[::1/x"])
def test_a_url_past_the_check_fails_its_own_deliveries_alone(tmp_path, url):
    """Receivers built in code skip the file's check: what the URL raises is that delivery's failure."""
    good = WebhookReceiver(free_port()).start()
    config = AlertConfig(receivers=(Receiver("bad", url), Receiver("good", good.url)), backoff_initial_s=0.1)
    con = duckdb.connect(str(tmp_path / "store.duckdb"))
    con.execute(DDL)
    finding = Finding("run-a", "rank", [3], 10, 20, "warning", 1.3, "rank 3 is slow", analyzer="stragglers")
    delivery = Delivery(config)
    delivery.start(con)
    try:
        findings.record(con, "run-a", "stragglers", [finding], [Outbox(config)])
        good.wait_for(1)
        findings.record(con, "run-a", "stragglers", [], [Outbox(config)])  # a later alert: the resolution
        good.wait_for(2)
        wait_until(
            lambda: con.execute("SELECT max(attempts) FROM outbox WHERE receiver = 'bad'").fetchone()[0] >= 2,
            "the bad receiver's notification was not retried",
        )
    finally:
        delivery.close()
        good.stop()
    rows = con.execute("SELECT receiver, state FROM outbox ORDER BY id").fetchall()
    assert rows == [("bad", "pending"), ("good", "delivered")] * 2  # the resolution waits behind the firing
    (error,) = con.execute("SELECT last_error FROM outbox WHERE receiver = 'bad' AND attempts > 0").fetchone()
    assert "\n" not in error and "/x" not in error, error  # one line, without the URL's path

"""The test notification of `rankwatch alerts test`: one firing alert, in the body and with the
signature real alerts have, so a receiver's parsing, verification and routing are checked
end to end before a real page depends on them."""

from datetime import UTC, datetime

import httpx

from collector.alerts import rules, webhook
from collector.alerts.config import Receiver

LABELS = {
    "alertname": "RankwatchTest",
    "run": "test",
    "analyzer": "test",
    "kind": "test",
    "severity": "warning",
    "ranks": "none",
}
SUMMARY = "A test alert from `rankwatch alerts test`: nothing is wrong."


def send(client: httpx.Client, receiver: Receiver, dashboard_url: str) -> int:
    """POST the test alert to `receiver`; its HTTP status, or webhook.DeliveryError."""
    alert = webhook.alert(
        "firing",
        LABELS,
        rules.annotations(SUMMARY, dashboard_url),
        datetime.now(UTC),
        None,
        dashboard_url,
        rules.fingerprint(LABELS),
    )
    body = webhook.message(receiver.name, [alert], rules.group_labels(LABELS), dashboard_url)
    return webhook.post(client, receiver.url, receiver.secret, webhook.new_id(), body)

"""The wire format of an alert notification.

The body is Alertmanager's webhook payload, version 4, so receivers written for
Alertmanager (chat bridges, paging services, incident tools) take it unchanged.
It is signed per Standard Webhooks (https://www.standardwebhooks.com/) so a
receiver can tell it came from this collector and was not replayed: headers
webhook-id (the same on every retry of one notification, for deduplication),
webhook-timestamp (of this attempt) and webhook-signature.
"""

import base64
import binascii
import hashlib
import hmac
import json
import time
import uuid
from datetime import UTC, datetime

import httpx

VERSION = "4"
ROUTE_KEY = "{}"  # Alertmanager's key of the root route, the first part of a groupKey
SECRET_PREFIX = "whsec_"
ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of an alert still firing


class DeliveryError(Exception):
    """A notification the receiver did not take (transport error or non-2xx), in one line."""


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def alert(
    status: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    starts_at: datetime,
    ends_at: datetime | None,
    generator_url: str,
    fingerprint: str,
) -> dict:
    """One entry of a notification's `alerts`."""
    return {
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(starts_at),
        "endsAt": rfc3339(ends_at) if ends_at else ZERO_TIME,
        "generatorURL": generator_url,
        "fingerprint": fingerprint,
    }


def message(receiver: str, alerts: list[dict], group_labels: dict[str, str], external_url: str) -> str:
    """The JSON body of one notification: a group's alerts, firing if any of them is."""

    def common(key: str) -> dict[str, str]:
        first, *rest = (a[key] for a in alerts)
        return {k: v for k, v in first.items() if all(other.get(k) == v for other in rest)}

    group = ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items()))
    return json.dumps(
        {
            "version": VERSION,
            "groupKey": f"{ROUTE_KEY}:{{{group}}}",
            "truncatedAlerts": 0,
            "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
            "receiver": receiver,
            "groupLabels": group_labels,
            "commonLabels": common("labels"),
            "commonAnnotations": common("annotations"),
            "externalURL": external_url,
            "alerts": alerts,
        }
    )


def new_id() -> str:
    """A webhook-id: unique per notification, kept across its retries."""
    return f"msg_{uuid.uuid4().hex}"


def signing_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: the base64 after "whsec_". ValueError if malformed."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX!r} (Standard Webhooks)")
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except binascii.Error:
        raise ValueError(f"the part of a webhook secret after {SECRET_PREFIX!r} must be base64") from None
    if not key:
        raise ValueError("the webhook secret's key is empty")
    return key


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature header: "v1," + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}"))."""
    mac = hmac.new(signing_key(secret), f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def redacted(text: str, url: str) -> str:
    """`text` with the URL's secret parts (user, path, query, as given and as httpx spells them) cut out: a
    delivery error is logged and stored, and a webhook URL is a secret."""
    parsed = httpx.URL(url)
    parts = {url, str(parsed), parsed.raw_path.decode("ascii", "replace"), parsed.path, parsed.query.decode()}
    for secret in sorted(parts | {parsed.userinfo.decode()}, key=len, reverse=True):
        if len(secret) > 1:
            text = text.replace(secret, "<url>" if "://" in secret else "/…")
    return text


def post(client: httpx.Client, url: str, secret: str | None, webhook_id: str, body: str) -> int:
    """POST one notification attempt, signed when the receiver has a secret; its HTTP status,
    or DeliveryError."""
    payload, timestamp = body.encode(), int(time.time())
    headers = {"content-type": "application/json", "webhook-id": webhook_id, "webhook-timestamp": str(timestamp)}
    if secret:
        headers["webhook-signature"] = sign(secret, webhook_id, timestamp, payload)
    try:
        response = client.post(url, content=payload, headers=headers)
    except httpx.HTTPError as e:
        raise DeliveryError(redacted(f"{type(e).__name__}: {e}", url)) from None
    if not response.is_success:
        raise DeliveryError(f"HTTP {response.status_code}")
    return response.status_code

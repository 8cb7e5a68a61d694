"""The wire format of an alert notification.

The body is Alertmanager's webhook payload, version 4, so receivers written for
Alertmanager (chat bridges, paging services, incident tools) take it unchanged.
It is signed per Standard Webhooks (https://www.standardwebhooks.com/) so a
receiver can tell it came from this collector and was not replayed: headers
webhook-id (the same on every retry of one notification, for deduplication),
webhook-timestamp (of this attempt) and webhook-signature.

A receiver is not trusted to answer well: the answer's body is never read (its status says
everything), so a gzip bomb inflates nothing, and a deadline bounds the whole attempt, so one
that answers a byte at a time holds it no longer than a silent one.
"""

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import socket
import threading
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


def check_url(url: str) -> None:
    """ValueError, in one line that does not quote the URL's secret parts, unless post() can send to `url`:
    an http or https URL with a host, that httpx parses and whose host name the resolver takes (socket
    encodes it to IDNA, refusing an empty or overlong label: `http://a..b/x`)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(redacted(f"url is not valid: {e}", url)) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError("url must be an http:// or https:// URL")
    try:
        parsed.raw_host.decode("ascii").encode("idna")
    except UnicodeError as e:
        raise ValueError(f"url's host name cannot be looked up: {e}") from None


def redacted(text: str, url: str) -> str:
    """`text` with the URL's secret parts (user, path, query, as given and as httpx spells them) cut out: a
    delivery error is logged and stored, and a webhook URL is a secret. A URL httpx cannot parse is cut out
    whole (httpx's complaint about it quotes a host, a port or a character, never more)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return text.replace(url, "<url>")
    parts = {url, str(parsed), parsed.raw_path.decode("ascii", "replace"), parsed.path, parsed.query.decode()}
    for secret in sorted(parts | {parsed.userinfo.decode()}, key=len, reverse=True):
        if len(secret) > 1:
            text = text.replace(secret, "<url>" if "://" in secret else "/…")
    return text


class _Deadline:
    """Ends one attempt `seconds` after it starts, wherever it is: httpx's timeouts bound each read and
    write alone, so a receiver that sends a byte within each would hold the attempt for ever. httpcore's
    trace hands over the socket of the attempt's connection (after TLS, the TLS socket), which is shut
    down when the time is up: the read or write waiting on it ends at once. No limit with `seconds` None."""

    _CONNECTED = ("connection.connect_tcp.complete", "connection.start_tls.complete")

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.expired = False
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = None if seconds is None else threading.Timer(seconds, self._expire)

    def __enter__(self) -> "_Deadline":
        if self._timer is not None:
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def trace(self, event: str, info: dict) -> None:
        """httpcore's `trace` extension, called on the attempt's thread."""
        if event in self._CONNECTED:
            with self._lock:
                self._socket = info["return_value"].get_extra_info("socket")
                if self.expired:  # the name took longer to look up than the whole attempt may
                    self._shut()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shut()

    def _shut(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):  # closed already
                self._socket.shutdown(socket.SHUT_RDWR)


def post(client: httpx.Client, url: str, secret: str | None, webhook_id: str, body: str) -> int:
    """POST one notification attempt, signed when the receiver has a secret; its HTTP status. The client's
    timeout bounds each read and write and, here, the attempt from start to end. Whatever goes wrong, the
    transport, a URL the socket layer refuses, a lack of memory, is DeliveryError in one line with the
    URL's secret parts cut out: the attempt's failure, never its caller's."""
    payload, timestamp = body.encode(), int(time.time())
    headers = {
        "content-type": "application/json",
        "accept-encoding": "identity",  # the answer's body goes unread, and compressed it would still inflate nothing
        "connection": "close",  # a connection of the attempt's own, whose socket the deadline can reach
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
    }
    if secret:
        headers["webhook-signature"] = sign(secret, webhook_id, timestamp, payload)
    deadline = _Deadline(client.timeout.read)
    try:
        with (
            deadline,
            client.stream(
                "POST", url, content=payload, headers=headers, extensions={"trace": deadline.trace}
            ) as response,
        ):
            status = response.status_code
    except Exception as e:  # any failure of the attempt is the attempt's
        reason = f"no answer within {deadline.seconds:g} s" if deadline.expired else _one_line(e)
        raise DeliveryError(redacted(reason, url)) from None
    if not httpx.codes.is_success(status):
        raise DeliveryError(f"HTTP {status}")
    return status


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

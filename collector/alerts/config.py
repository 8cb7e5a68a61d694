"""The receivers file: where alert notifications go, and which alerts each receiver wants.

TOML, or JSON for a name ending in .json; read once when the collector starts
(`rankwatch collector --alerts FILE`, by default `alerts.toml` beside the store)
and by `rankwatch alerts test`. Mistakes fail the start with one line, so a
typo never silently drops a page:

    dashboard_url = "http://127.0.0.1:8501"   # where the alerts' links point
    backoff_max_s = 60                        # the longest wait between retries

    [[receivers]]
    name = "oncall"                           # default: webhook-<hash of the URL>
    url = "https://hooks.example.com/rankwatch"
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"   # Standard Webhooks; optional
    severities = ["critical"]                 # and/or analyzers = [...], kinds = [...]

A receiver's name labels it on the unauthenticated /metrics and in the log, so it is never
its URL: webhook URLs are secrets (Slack's carry their key in the path).
"""

import hashlib
import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from collector.alerts.webhook import check_url, signing_key
from rankwatch.agent.config import DASHBOARD_PORT
from rankwatch.agent.paths import ALERTS_FILE

DEFAULT_DASHBOARD_URL = f"http://127.0.0.1:{DASHBOARD_PORT}"
_FILTERS = ("analyzers", "kinds", "severities")  # receiver keys, each matched against a label
_LABEL = {"analyzers": "analyzer", "kinds": "kind", "severities": "severity"}


class AlertConfigError(ValueError):
    """A receivers file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Receiver:
    """One webhook endpoint; a filter left out (None) lets every alert through."""

    name: str
    url: str
    secret: str | None = None
    analyzers: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    severities: frozenset[str] | None = None

    def wants(self, labels: dict[str, str]) -> bool:
        return all(
            allowed is None or labels.get(_LABEL[key]) in allowed
            for key, allowed in ((key, getattr(self, key)) for key in _FILTERS)
        )


@dataclass(frozen=True)
class AlertConfig:
    """Receivers and delivery settings; the default has no receiver (alerts are kept, not sent)."""

    receivers: tuple[Receiver, ...] = ()
    dashboard_url: str = DEFAULT_DASHBOARD_URL
    backoff_initial_s: float = 1.0  # the first retry's wait; it doubles per failure, with jitter
    backoff_max_s: float = 60.0
    timeout_s: float = 5.0  # one POST's limit


def default_path(db: Path) -> Path:
    return db.parent / ALERTS_FILE


def load(path: Path) -> AlertConfig:
    """The receivers file at `path`, checked; AlertConfigError says what is wrong in one line."""
    try:
        text = path.read_text()
        document = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as e:
        raise AlertConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise AlertConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    try:
        return _parse(document)
    except (ValueError, TypeError) as e:
        raise AlertConfigError(f"{path}: {e}") from None


def _parse(document) -> AlertConfig:
    if not isinstance(document, dict):
        raise ValueError("the file must hold a table (TOML) or an object (JSON)")
    settings = {f.name for f in fields(AlertConfig)} - {"receivers"}
    unknown = set(document) - settings - {"receivers"}
    if unknown:
        raise ValueError(f"unknown setting {min(unknown)!r}; settings: receivers, {', '.join(sorted(settings))}")
    for key in settings & set(document) - {"dashboard_url"}:
        if not isinstance(document[key], (int, float)) or document[key] <= 0:
            raise ValueError(f"{key} must be a positive number of seconds")
    if not isinstance(document.get("dashboard_url", ""), str):
        raise ValueError("dashboard_url must be a string")
    entries = document.get("receivers", [])
    if not isinstance(entries, list):
        raise ValueError("receivers must be a list ([[receivers]] in TOML)")
    receivers = tuple(receiver(entry, f"receiver {i + 1}") for i, entry in enumerate(entries))
    names = [r.name for r in receivers]
    if len(set(names)) != len(names):
        raise ValueError(
            f"two receivers are named {next(n for n in names if names.count(n) > 1)!r} (one without a name is "
            "named after its URL's digest)"
        )
    return AlertConfig(receivers=receivers, **{k: v for k, v in document.items() if k != "receivers"})


def receiver(entry, where: str) -> Receiver:
    """One receiver's table, checked; ValueError starting with `where` says what is wrong."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a table")
    unknown = set(entry) - {"name", "url", "secret", *_FILTERS}
    if unknown:
        raise ValueError(f"{where}: unknown key {min(unknown)!r}; keys: name, url, secret, {', '.join(_FILTERS)}")
    url = entry.get("url")
    if not isinstance(url, str):
        raise ValueError(f"{where}: url must be an http:// or https:// URL")
    try:
        check_url(url)  # what the delivery could not send to
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    secret = entry.get("secret")
    if secret is not None:
        if not isinstance(secret, str):
            raise ValueError(f"{where}: secret must be a string")
        try:
            signing_key(secret)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    filters = {}
    for key in _FILTERS:
        if key in entry:
            values = entry[key]
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"{where}: {key} must be a list of strings")
            filters[key] = frozenset(values)
    name = entry.get("name", default_name(url))
    if not isinstance(name, str) or not name.strip() or "://" in name:
        raise ValueError(f"{where}: name must be a short label, not empty and not a URL (it shows on /metrics)")
    return Receiver(name=name, url=url, secret=secret, **filters)


def default_name(url: str) -> str:
    """The label of a receiver without a name: a digest of its URL, which it does not reveal."""
    return f"webhook-{hashlib.sha256(url.encode()).hexdigest()[:10]}"

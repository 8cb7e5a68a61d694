"""Where a rank finds its collector, token and run id: arguments, then the environment,
then the defaults a newcomer gets (which the collector shares). Files: agent/paths.py."""

import os
import time

from agent import paths

DEFAULT_COLLECTOR = "http://127.0.0.1:4318"
UNDELIVERED_ENV = "RANKWATCH_UNDELIVERED"  # where a rank notes the telemetry it never delivered (rankwatch train)


def collector_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("RANKWATCH_COLLECTOR") or DEFAULT_COLLECTOR


def token(explicit: str | None = None) -> str | None:
    """The ingest token: given, $RANKWATCH_TOKEN, or the token file of the default store."""
    if explicit or os.environ.get("RANKWATCH_TOKEN"):
        return explicit or os.environ["RANKWATCH_TOKEN"]
    path = paths.store_path().parent / paths.TOKEN_FILE
    return path.read_text().strip() if path.exists() else None


def run_id(explicit: str | None = None) -> str:
    """Given, $RANKWATCH_RUN_ID, torchrun's rendezvous id, or one made from the time."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    return (
        explicit
        or os.environ.get("RANKWATCH_RUN_ID")
        or (elastic if elastic not in (None, "", "none") else None)
        or time.strftime("run-%Y%m%d-%H%M%S")
    )

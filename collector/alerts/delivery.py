"""Posting the outbox: a thread in the store's writer process.

The outbox is in the store and only the writer process may open it, so the
poster lives there, as a thread that spends its time asleep or waiting on a
socket (the writer's commits do not wait for it): a task the collector hands
the writer (collector/store/writer.py). It reads and updates rows
on a cursor of its own, DuckDB's connection for another thread.

Every POLL_S it takes the due notifications, oldest first. A receiver that
fails is left alone for an exponential backoff with jitter (backoff_initial_s
doubling up to backoff_max_s, times a random 0.5..1), all its notifications
with it, so one that is down for hours costs one request per interval; when it
answers again every notification goes out in order. A retry carries the same
webhook-id, so a receiver that saw an attempt whose answer was lost can drop
the repeat. Notifications for a receiver no longer configured are dropped;
those still undelivered after EXPIRE_AFTER expire.

No receiver can stop the thread: an attempt is bounded by timeout_s from
start to end and never reads the answer's body (webhook.post), and whatever
goes wrong in it is that attempt's failure, retried; anything else that goes
wrong in a pass is logged and the next pass comes as usual.
"""

import logging
import random
from datetime import UTC, datetime, timedelta

import duckdb
import httpx

from collector.alerts import outbox, webhook
from collector.alerts.config import AlertConfig
from collector.store import lake
from collector.store.writer import PeriodicTask

log = logging.getLogger("rankwatch.alerts")
POLL_S = 0.5
EXPIRE_AFTER = timedelta(days=1)
# In a lake shared by several collectors (collector/store/lake.py) one of them posts the outbox at a time:
# the holder of the alerts lease, renewed at every poll, taken over once it has been let expire this long.
LEASE_HELD = timedelta(seconds=5)


class Delivery(PeriodicTask):
    """The posting thread, a task of the store's writer; it runs only when a receiver is configured."""

    every_s = POLL_S
    thread_name = "rankwatch-alerts"

    def __init__(self, config: AlertConfig):
        self._config = config
        self._receivers = {r.name: r for r in config.receivers}
        self._client: httpx.Client | None = None  # made on the posting thread

    def close(self) -> None:
        """Stop after the attempt in flight (at most timeout_s, whatever the receiver does)."""
        super().close()
        if self._client is not None:
            self._client.close()

    def wanted(self, con: duckdb.DuckDBPyConnection) -> bool:
        self._shared = lake.attached(con)  # a lake's collectors: one posts at a time
        return bool(self._config.receivers)

    def backoff_s(self, attempts: int) -> float:
        """The wait after a receiver's `attempts`-th failure in a row (counting from 0)."""
        cap = min(self._config.backoff_max_s, self._config.backoff_initial_s * 2 ** min(attempts, 32))
        return cap * random.uniform(0.5, 1.0)

    def tick(self, con: duckdb.DuckDBPyConnection) -> None:
        try:
            if self._client is None:
                self._client = httpx.Client(timeout=self._config.timeout_s)
            self._deliver_due(self._client, con)
        except Exception:  # the thread goes on: a pass that failed is tried again at the next
            log.exception("alert delivery: a pass failed")

    def _deliver_due(self, client: httpx.Client, con: duckdb.DuckDBPyConnection) -> None:
        if self._shared and not lake.lease(con, "alerts", "", LEASE_HELD):
            return  # another collector of the lake posts them
        failed: set[str] = set()  # receivers that failed in this pass: their later notifications wait
        expired_before = datetime.now(UTC) - EXPIRE_AFTER
        for notification in outbox.due(con):
            if self.stopping:
                return
            receiver = self._receivers.get(notification.receiver)
            if receiver is None:
                outbox.settle(con, notification, "dropped", "receiver no longer configured")
            elif notification.created_at < expired_before:
                outbox.settle(con, notification, "expired", f"undelivered after {EXPIRE_AFTER}")
            elif notification.receiver not in failed:
                try:
                    webhook.post(client, receiver.url, receiver.secret, notification.webhook_id, notification.body)
                except webhook.DeliveryError as e:
                    failed.add(receiver.name)
                    log.warning("alert delivery to %s failed (%s); retrying", receiver.name, e)
                    outbox.postpone(con, notification, self.backoff_s(notification.attempts), str(e))
                else:
                    outbox.settle(con, notification, "delivered")

"""What one consumer instance holds, and its start-up order.

``start``: create the tables (the database itself must exist), start the key-store publisher
(its first sweep republishes keys a crash left unpublished), then rebuild the key view from the
compacted topic, measuring the time. Only then is the instance ready; the receiver answers 503
until it is, and the queue consumer does not subscribe before.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry
from psycopg_pool import ConnectionPool

from consumers.dedup import Deduplicator
from consumers.inbox import (
    REFERENCE_CHANGE,
    Change,
    Inbox,
    StatementChange,
    apply_migrations,
)
from consumers.keystore import KeyStorePublisher, KeyView, RestoreReport, restore
from consumers.metrics import ConsumerMetrics
from ledger import pg
from ledger.domain.redact import redact
from ledger.pg import open_async_pool, open_pool
from ledger.settings import Settings

log = logging.getLogger("opledger.consumer")


class ConsumerSetupError(RuntimeError):
    """The consumer cannot start; the message says what to do."""


def migrate_database(dsn: str) -> list[int]:
    """Apply the consumer's migrations to ``dsn``; a missing database is explained, not created."""
    try:
        # Unbounded lock waits: consumers starting together queue on the migrations' lock.
        with pg.connect(
            dsn, name="opledger-consumer-migrate", connect_timeout=10, lock_timeout_ms=None
        ) as conn:
            return apply_migrations(conn)
    except psycopg.OperationalError as exc:
        where = redact(dsn)
        if "does not exist" in str(exc):
            raise ConsumerSetupError(
                f"the consumer's database in {where} does not exist; create it (`opledger "
                "stack up` does on the local stack) or point OPLEDGER_CONSUMER_PG_DSN at another"
            ) from None
        raise ConsumerSetupError(f"cannot reach the consumer's database at {where}") from exc


class ConsumerRuntime:
    """Key view, publisher, metrics and the publisher's (blocking) pool of one consumer
    instance; each transport opens its inbox on its own event loop (:meth:`open_inbox`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        name: str | None = None,
        change: StatementChange | Change = REFERENCE_CHANGE,
        registry: CollectorRegistry | None = None,
        pool_size: int = 10,
        sweep_interval_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.name = name or settings.consumer_name
        self.registry = registry or CollectorRegistry()
        self.metrics = ConsumerMetrics.create(self.registry)
        self.pool: ConnectionPool[Any] = open_pool(
            settings.consumer_dsn,
            name=f"opledger-consumer-{self.name}",
            max_size=pool_size,
            lock_timeout_ms=settings.pg_lock_timeout_ms,
        )
        labels = (self.name,)
        self.publisher = KeyStorePublisher(
            settings,
            self.name,
            self.pool,
            on_lag=self.metrics.publish_lag_seconds.labels(*labels).observe,
            on_unpublished=self.metrics.unpublished_keys.labels(*labels).set,
            on_republished=self.metrics.republished.labels(*labels).inc,
            on_failure=self.metrics.publish_failures.labels(*labels).inc,
            sweep_interval_s=sweep_interval_s,
        )
        self.change = change
        self.view = KeyView()
        self.dedup = Deduplicator(self.name, self.view, self.publisher, self.metrics)
        self.ready = False
        self.restored: RestoreReport | None = None

    def start(self) -> RestoreReport:
        """Migrate, start publishing, restore the view; blocking. Then :attr:`ready`."""
        migrate_database(self.settings.consumer_dsn)
        self.publisher.start()
        report = restore(self.settings, self.name, self.view)
        self.metrics.restore_seconds.labels(self.name).set(report.seconds)
        self.metrics.restored_keys.labels(self.name).set(report.keys)
        log.info(
            "consumer %s: key view restored from %s in %.3fs: %d keys (%d records read, %d "
            "skipped); serving",
            self.name,
            self.settings.consumer_keys_topic,
            report.seconds,
            report.keys,
            report.records,
            report.skipped,
        )
        self.restored = report
        self.ready = True
        return report

    async def open_inbox(self, connections: int = 3) -> Inbox:
        """An inbox on a pool of its own, bound to the running event loop (close it with
        :meth:`Inbox.close`)."""
        pool = open_async_pool(
            self.settings.consumer_dsn,
            name=f"opledger-consumer-{self.name}",
            max_size=connections,
            lock_timeout_ms=self.settings.pg_lock_timeout_ms,
        )
        await pool.open(wait=False)
        return Inbox(self.name, pool, self.change)

    def health(self) -> dict[str, Any]:
        return {
            "consumer": self.name,
            "ready": self.ready,
            "keys": len(self.view),
            "restore_seconds": None if self.restored is None else round(self.restored.seconds, 3),
        }

    def close(self) -> None:
        self.ready = False
        self.publisher.close()
        self.pool.close()

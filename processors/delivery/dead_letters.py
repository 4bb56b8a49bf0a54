"""``opledger_dead_lettered_deliveries``: this worker's partitions' dead letters per destination,
as the projection counts them, refreshed at most every few seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger.errors import RecordError
from ledger.metrics import Metrics
from ledger.pg import retrying

log = logging.getLogger("opledger.delivery")

_DEAD_LETTERED_SQL = """
SELECT d.destination, count(*)
  FROM deliveries d
  JOIN agent_operations o ON o.operation_id = d.operation_id
 WHERE o.kafka_partition = ANY(%s) AND d.state = 'DEAD_LETTERED'
 GROUP BY d.destination
"""


class DeadLetterGauge:
    """The gauge of dead letters of the partitions ``partitions()`` names."""

    def __init__(
        self,
        pool: ConnectionPool[Any],
        metrics: Metrics,
        partitions: Callable[[], Collection[int]],
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._partitions = partitions
        self._refreshed_at = 0.0

    def refresh(self, every_s: float = 5.0) -> None:
        """Count again, unless it was counted less than ``every_s`` seconds ago; a database
        that does not answer leaves the gauge as it was."""
        monotonic = time.monotonic()
        partitions = sorted(self._partitions())
        if monotonic - self._refreshed_at < every_s or not partitions:
            return
        self._refreshed_at = monotonic

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(_DEAD_LETTERED_SQL, (partitions,)).fetchall()

        try:
            rows = retrying(self._pool, "count dead-lettered deliveries", work)
        except RecordError as exc:
            log.debug("dead-letter gauge not refreshed: %s", exc)
            return
        self._metrics.dead_lettered_deliveries.clear()
        for destination, count in rows:
            self._metrics.dead_lettered_deliveries.labels(destination).set(count)

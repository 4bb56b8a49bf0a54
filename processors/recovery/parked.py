"""``opledger_parked_oldest_age_seconds``: how long the oldest parked operation has waited for a
person, as the projection says, refreshed at most every few seconds."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger.errors import RecordError
from ledger.metrics import Metrics
from ledger.pg import retrying

log = logging.getLogger("opledger.recovery")

_PARKED_AGE_SQL = """
SELECT COALESCE(extract(epoch FROM now() - min(decided_at)), 0)
  FROM agent_operations WHERE parked IS NOT NULL
"""


class ParkedGauge:
    """The gauge of the oldest parked operation's age."""

    def __init__(self, pool: ConnectionPool[Any], metrics: Metrics) -> None:
        self._pool = pool
        self._metrics = metrics
        self._refreshed_at = 0.0

    def refresh(self, every_s: float = 5.0) -> None:
        """Measure again, unless it was measured less than ``every_s`` seconds ago; a database
        that does not answer leaves the gauge as it was."""
        now = time.monotonic()
        if now - self._refreshed_at < every_s:
            return
        self._refreshed_at = now

        def work(conn: psycopg.Connection[Any]) -> float:
            row = conn.execute(_PARKED_AGE_SQL).fetchone()
            return 0.0 if row is None else float(row[0])

        try:
            self._metrics.parked_oldest_age_seconds.set(
                retrying(self._pool, "measure parked operations", work)
            )
        except RecordError as exc:
            log.debug("parked age not refreshed: %s", exc)

"""The delivery worker: its passes, in order, with their clients (decision 010).

Each pass reads the outbox (:mod:`~processors.delivery.outbox`: SUCCEEDED executions open one
PENDING per destination), has the previous pass's answers judged (:mod:`~processors.delivery.judge`:
ACKED, PENDING with a backoff, DEAD_LETTERED), then starts the sends that are due
(:mod:`~processors.delivery.sending`: SENT recorded before each leaves). The records they write
are :mod:`~processors.delivery.records`'. The worker loads results by reference and never calls
a tool; its results page is :mod:`~processors.delivery.results_server`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException
from psycopg_pool import ConnectionPool

from ledger.codec import Codec, default_codec
from ledger.destinations import DestinationStore
from ledger.domain.schedule import RetryPolicy
from ledger.errors import RecordError
from ledger.history import HistoryError, HistoryReader
from ledger.kafka import FETCH_STALL_S
from ledger.log import LogTopics, LogWriter, Transport
from ledger.metrics import Metrics
from ledger.pg import DatabaseUnavailableError
from ledger.policy_store import PolicyViewStaleError
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.delivery.dead_letters import DeadLetterGauge
from processors.delivery.judge import Judge
from processors.delivery.outbox import Outbox
from processors.delivery.records import Outcomes, Records
from processors.delivery.senders import WebhookSender
from processors.delivery.sending import SEND_BATCH, InFlight, PolicyCheck, Sender
from processors.health import Health

__all__ = ["SEND_BATCH", "DeliveryWorker"]

log = logging.getLogger("opledger.delivery")


class DeliveryWorker:
    """One member of the delivery group; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        pool: ConnectionPool[Any],
        transport: Transport,
        history: HistoryReader,
        results: ResultStore,
        destinations: DestinationStore,
        policy: PolicyCheck,
        webhooks: WebhookSender,
        metrics: Metrics,
        codec: Codec | None = None,
        retry: RetryPolicy | None = None,
        unit_random: Callable[[], float] = random.random,
        outbox_stall_s: float = FETCH_STALL_S,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        codec = codec or default_codec()
        retry = retry or settings.delivery_retry_policy
        self._stopping = threading.Event()
        self.health = Health("delivery worker")
        records = Records(LogWriter(transport, LogTopics.of(settings), "delivery", codec=codec))
        self._records = records
        outcomes = Outcomes(metrics)
        self.outbox = Outbox(
            settings,
            history=history,
            destinations=destinations,
            records=records,
            outcomes=outcomes,
            metrics=metrics,
            codec=codec,
            health=self.health,
            release=self._release,
            stall_s=outbox_stall_s,
        )
        self.sender = Sender(
            settings,
            pool=pool,
            transport=transport,
            history=history,
            results=results,
            destinations=destinations,
            policy=policy,
            webhooks=webhooks,
            records=records,
            outcomes=outcomes,
            metrics=metrics,
            retry=retry,
            partitions=lambda: self.outbox.partitions,
        )
        self.judge = Judge(
            destinations=destinations,
            records=records,
            outcomes=outcomes,
            metrics=metrics,
            retry=retry,
            unit_random=unit_random,
            pause=self.sender.pause,
        )
        self._dead_letters = DeadLetterGauge(pool, metrics, lambda: self.outbox.partitions)
        #: the sends the last pass started, whose outcomes the next pass records
        self._in_flight: InFlight | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    def run(self, max_passes: int | None = None) -> None:
        """Join the group and work until :meth:`stop` (or ``max_passes``, for tests)."""
        self.join()
        try:
            while not self._stopping.is_set() and (
                max_passes is None or self.health.done < max_passes
            ):
                self.run_once()
        finally:
            self.close()

    def join(self) -> None:
        self.outbox.join()

    def close(self) -> None:
        self._drain("closing")
        self.outbox.close()
        self.sender.close()

    @property
    def partitions(self) -> set[int]:
        return self.outbox.partitions

    def _drain(self, why: str) -> None:
        """Record the outcomes of the sends in flight before their partitions may move."""
        try:
            self._finish()
        except Exception as exc:  # their SENTs go stale and are sent again, same key
            log.warning("outcomes of the sends in flight not recorded (%s): %s", why, exc)

    def _release(self, why: str) -> None:
        """Partitions are given up: the next owner must find the outcomes of this worker's
        sends, not SENTs to redo; and another worker may write these deliveries now, so what
        this one remembers of them may go stale (the log has every one)."""
        self._drain(why)
        self._records.forget()
        self.sender.forget()

    # -- one pass ----------------------------------------------------------------------------

    def run_once(self, timeout: float | None = None) -> int:
        """Read the outbox (waiting up to ``timeout`` for records), record the outcomes of the
        sends the previous pass started, then start the sends that are due now; returns how
        many sends were started. Never raises for a dependency that is away.

        A pass's sends are in flight while the next pass reads its outbox: the two touch
        different deliveries (an outbox opens new ones only), and every delivery's steps stay
        in order: SENT acknowledged, then the request, then its outcome appended, before the
        pass that follows picks anything to send."""
        assert self.outbox.joined, "join() first"
        wait = self._settings.delivery_interval_ms / 1000 if timeout is None else timeout
        started = time.monotonic()
        try:
            try:
                # With sends in flight there is work waiting: read only what has arrived.
                fresh = self.outbox.read(0.0 if self._in_flight is not None else wait)
            finally:
                self._finish()
            assert self._in_flight is None, "the previous pass's sends are finished first"
            self._in_flight = self.sender.send(fresh)
            self._metrics.delivery_pool_waiting.set(self.sender.waiting)
        except (
            DatabaseUnavailableError,
            HistoryError,
            KafkaException,
            RecordError,
            PolicyViewStaleError,
        ) as exc:
            self.health.stalled(f"{type(exc).__name__}: {exc}")
            log.warning("delivery pass failed, trying again next pass: %s", exc)
            self._stopping.wait(1.0)
            return 0
        self._dead_letters.refresh()
        self.health.ok()
        self._metrics.delivery_pass_seconds.observe(time.monotonic() - started)
        return 0 if self._in_flight is None else len(self._in_flight.items)

    def _finish(self) -> None:
        """Have the judge record the outcomes of the sends in flight."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self.judge.record(in_flight)

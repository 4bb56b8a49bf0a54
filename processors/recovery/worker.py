"""The recovery worker: what happens to an operation whose owner went away (decision 006); its
passes, in order, with their clients.

Every pass looks, on the partitions its consumer group gave it, for operations that are not
finished and whose lease has expired, and takes them over (:mod:`~processors.recovery.detector`:
new lease token, recorded first, history read up to that record; a DISPATCHED attempt older than
the tool's call timeout is recorded UNKNOWN, with the reason). Then it applies the seed's recovery
rules, with policy as it is now (:mod:`~processors.recovery.policy`):

- INTENT_RECORDED (the owner went away before dispatching, so no provider call happened):
  dispatched once, after a policy check, with the stored request (seed row 1;
  :mod:`~processors.recovery.resume`);
- UNKNOWN: the provider is asked by idempotency key (:mod:`~processors.recovery.lookups`) and
  the operation decided (:mod:`~processors.recovery.reconcile`, ``ledger.domain.reconcile``):
  what the provider says happened is recorded (a recovered result stored first, seed row 3), a
  new attempt only when policy explicitly allows it and the key is within the provider's
  retention, a parked or refused operation otherwise, and never a call while the provider cannot
  be asked.

The calls those decisions permit are made through the call rule
(:mod:`~processors.recovery.calls`). Every decision is an event with its evidence
(``ReconciliationDecided``), and the transition it causes cites it; the pass's records are sent
together (:mod:`~processors.recovery.records`). The worker reads its state from the projection and
the unprojected tail (``ledger.history``); it keeps nothing of its own but a short in-memory
backoff per operation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from psycopg_pool import ConnectionPool

from ledger.codec import Codec
from ledger.domain.reconcile import Decision
from ledger.domain.states import ExecutionState
from ledger.errors import RecordError
from ledger.history import HistoryError, HistoryReader
from ledger.leases import LeaseStore
from ledger.log import LogTopics, LogWriter, Transport, new_consumer
from ledger.metrics import Metrics
from ledger.pg import DatabaseUnavailableError
from ledger.policy_store import PolicyViewStaleError
from ledger.results import ResultStore
from ledger.settings import Settings
from ledger.tools import Provider
from processors.health import Health
from processors.recovery.calls import Caller
from processors.recovery.detector import BATCH, Detector
from processors.recovery.lookups import Backoff, Lookups
from processors.recovery.parked import ParkedGauge
from processors.recovery.policy import CurrentPolicy, PolicyCheck
from processors.recovery.reconcile import Reconcile
from processors.recovery.records import Operation, Records, guarded
from processors.recovery.resume import Resume
from processors.recovery.texts import said

__all__ = ["BATCH", "PolicyCheck", "RecoveryWorker"]

log = logging.getLogger("opledger.recovery")


class RecoveryWorker:
    """One member of the recovery group; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        pool: ConnectionPool[Any],
        transport: Transport,
        leases: LeaseStore,
        history: HistoryReader,
        results: ResultStore,
        policy: PolicyCheck,
        providers: Iterable[Provider],
        metrics: Metrics,
        codec: Codec | None = None,
        threads: int = 32,
    ) -> None:
        self._settings = settings
        self._leases = leases
        self._metrics = metrics
        self._stopping = threading.Event()
        self._consumer: Consumer | None = None
        self._assigned: set[int] = set()
        #: why this pass decided nothing for some operations (a stale policy view), if so
        self._held_for_policy: str | None = None
        self.health = Health("recovery worker")
        by_tool = {p.tool_name: p for p in providers}
        records = Records(
            LogWriter(transport, LogTopics.of(settings), "recovery", codec=codec), results
        )
        self._records = records
        backoff = Backoff()
        self.lookups = Lookups(by_tool, metrics=metrics, backoff=backoff, threads=threads)
        self.detector = Detector(
            settings,
            pool=pool,
            history=history,
            leases=leases,
            providers=by_tool,
            records=records,
            metrics=metrics,
            backoff=backoff,
            in_lookup=self.lookups.under_way,
        )
        self._policy = CurrentPolicy(settings, policy)
        self.resume = Resume(records=records, metrics=metrics)
        self.reconcile = Reconcile(
            records=records, results=results, metrics=metrics, backoff=backoff
        )
        self.calls = Caller(
            leases=leases, records=records, results=results, metrics=metrics, threads=threads
        )
        self.parked = ParkedGauge(pool, metrics)

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    def run(self, max_passes: int | None = None) -> None:
        """Join the group and work until :meth:`stop` (or ``max_passes``, for tests)."""
        self.join()
        interval = self._settings.recovery_interval_ms / 1000
        try:
            while not self._stopping.is_set() and (
                max_passes is None or self.health.done < max_passes
            ):
                self.poll_group(interval)
                self.run_once()
        finally:
            self.close()

    def join(self) -> None:
        """Subscribe to the execution topic in the recovery group. Records are not read (the
        partitions are paused): the assignment alone says which operations are this worker's."""
        consumer = new_consumer(
            self._settings,
            group_id=self._settings.recovery_group,
            client_id="opledger-recovery",
            overrides={
                "partition.assignment.strategy": "cooperative-sticky",
                # A SIGKILLed worker's partitions move once its session ends: 10 s, not the
                # default 45 s, during which nobody would sweep its operations.
                "session.timeout.ms": 10_000,
                "heartbeat.interval.ms": 2_000,
            },
        )
        consumer.subscribe(
            [self._settings.execution_topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        self._consumer = consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        self.calls.close()
        self.lookups.close()
        self._policy.close()

    def poll_group(self, timeout: float) -> None:
        """Serve the group protocol (rebalances, heartbeats) for up to ``timeout`` seconds."""
        assert self._consumer is not None, "join() first"
        message = self._consumer.poll(timeout)
        error = None if message is None else message.error()
        if error is not None and error.code() != KafkaError._PARTITION_EOF:
            log.warning("recovery group: %s", error)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        consumer.pause(partitions)
        self._assigned |= {p.partition for p in partitions}
        self.health.partitions = tuple(sorted(self._assigned))
        log.info("recovery worker now looks after partitions %s", sorted(self._assigned))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned -= {p.partition for p in partitions}
        consumer.incremental_unassign(partitions)
        self.health.partitions = tuple(sorted(self._assigned))

    @property
    def partitions(self) -> set[int]:
        return set(self._assigned)

    # -- one pass ----------------------------------------------------------------------------

    def run_once(self, partitions: Iterable[int] | None = None) -> int:
        """Look after every due operation of ``partitions`` (default: the assigned ones);
        returns how many were handled. Never raises for a dependency that is away."""
        wanted = sorted(self._assigned if partitions is None else set(partitions))
        if not wanted:
            self.health.ok()
            return 0
        started = time.monotonic()
        self._held_for_policy = None
        try:
            handled = self._pass(wanted)
        except (DatabaseUnavailableError, HistoryError, KafkaException, RecordError) as exc:
            self.health.stalled(f"{type(exc).__name__}: {exc}")
            log.warning("recovery pass failed, trying again next pass: %s", exc)
            self._stopping.wait(1.0)
            return 0
        self.parked.refresh()
        if self._held_for_policy is not None:
            self.health.stalled(self._held_for_policy)
        else:
            self.health.ok()
        self._metrics.recovery_pass_seconds.observe(time.monotonic() - started)
        return handled

    def _pass(self, partitions: Sequence[int]) -> int:
        operations, leases = self.detector.take_over(partitions)
        if not leases:
            return 0
        for operation in operations:
            guarded(operation, self.detector.detect)
        self.lookups.look_up_and_decide(operations, self._decide)
        # Only the provider calls the decisions permit go to the call threads.
        self.calls.call_all(self.calls.with_requests(operations, self._prepare_call))
        held = [s for s in operations if isinstance(s.failure, PolicyViewStaleError)]
        if held:
            # One line for all of them, and /healthz says why nothing is decided.
            self._held_for_policy = f"{len(held)} operations held: {held[0].failure}"
            log.warning("recovery pass: %s", self._held_for_policy)
        for operation in operations:
            if operation.failure is not None and operation not in held:
                # one operation's trouble never stops the others
                log.warning("an operation was left for a later pass: %s", said(operation.failure))
        handled = self._records.send_pass(operations)
        self._leases.release(leases)
        return handled

    def _decide(self, group: Sequence[Operation]) -> None:
        """Policy read for ``group`` as it is now, then each operation decided by its pass."""
        self._policy.read(group)
        for operation in group:
            guarded(operation, self._decide_one)

    def _decide_one(self, operation: Operation) -> None:
        if operation.execution.state is ExecutionState.INTENT_RECORDED:
            self.resume.decide(operation)
        elif operation.execution.state is ExecutionState.UNKNOWN:
            self.reconcile.decide(operation)

    def _prepare_call(self, operation: Operation) -> None:
        if operation.wants_call is Decision.RESUME:
            self.resume.prepare(operation)
        else:
            self.reconcile.prepare(operation)

"""The outbox pass: every SUCCEEDED execution opens one PENDING delivery per destination
(decision 010).

The outbox reads the execution topic in the delivery group, whose assignment also says whose
deliveries this worker sends. For every SUCCEEDED execution (confirmed against the log: the fold
accepted it) it appends one PENDING per destination configured for the operation's tenant and
tool, and commits its position only after those appends were acknowledged. The PENDINGs are
derived from the SUCCEEDED step alone (``ledger.domain.delivery.outbox_pendings``), so after a
crash between the appends and the commit the same events are written again and the fold counts
them as duplicates: every destination gets one delivery (the seed's row "after result write,
before delivery enqueue").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from pydantic import ValidationError

from ledger.codec import EXECUTION_RECORD, Codec
from ledger.destinations import DestinationStore
from ledger.domain.delivery import outbox_pendings
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned
from ledger.domain.fold import Applied, ExecutionRecord, apply_delivery
from ledger.domain.states import ExecutionState
from ledger.faults import fault_point
from ledger.history import HistoryReader
from ledger.kafka import FetchStallClock, listed, records_waiting
from ledger.log import new_consumer
from ledger.metrics import Metrics
from ledger.settings import Settings
from processors.delivery.records import Item, Outcomes, Records
from processors.health import Health

log = logging.getLogger("opledger.delivery")

#: Execution records the outbox reads per pass.
OUTBOX_BATCH = 6000
_SUCCEEDED_EXECUTION = (EXECUTION_RECORD, ExecutionState.SUCCEEDED.value)


class Outbox:
    """The delivery group's member: reads the execution topic and opens the deliveries of what
    succeeded. Before partitions are given up it calls ``release(why)``, which records the
    outcomes of the sends in flight and forgets what the worker remembers of its deliveries."""

    def __init__(
        self,
        settings: Settings,
        *,
        history: HistoryReader,
        destinations: DestinationStore,
        records: Records,
        outcomes: Outcomes,
        metrics: Metrics,
        codec: Codec,
        health: Health,
        release: Callable[[str], None],
        stall_s: float,
    ) -> None:
        self._settings = settings
        self._history = history
        self._destinations = destinations
        self._records = records
        self._outcomes = outcomes
        self._metrics = metrics
        self._codec = codec
        self._health = health
        self._release = release
        self._consumer: Consumer | None = None
        self._assigned: set[int] = set()
        #: partition -> when it was assigned (a partition just assigned is not stalled)
        self._assigned_at: dict[int, float] = {}
        self._stall = FetchStallClock(stall_s)

    # -- the group -----------------------------------------------------------------------------

    def join(self) -> None:
        consumer = new_consumer(
            self._settings,
            group_id=self._settings.delivery_group,
            client_id="opledger-delivery",
            overrides={
                "partition.assignment.strategy": "cooperative-sticky",
                # A SIGKILLed worker's partitions move once its session ends: 10 s, not the
                # default 45 s, during which nobody would send its deliveries.
                "session.timeout.ms": 10_000,
                "heartbeat.interval.ms": 2_000,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # A new group starts at the beginning: every SUCCEEDED execution on the topic
                # gets its deliveries (those that exist already are recognised as such).
                "auto.offset.reset": "earliest",
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

    @property
    def joined(self) -> bool:
        return self._consumer is not None

    @property
    def consumer(self) -> Consumer | None:
        """The group's consumer (None before :meth:`join`)."""
        return self._consumer

    @property
    def partitions(self) -> set[int]:
        """The execution topic's partitions the group gave this worker."""
        return set(self._assigned)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        self._assigned |= {p.partition for p in partitions}
        self._assigned_at.update((p.partition, time.monotonic()) for p in partitions)
        self._health.partitions = tuple(sorted(self._assigned))
        log.info("delivery worker now looks after partitions %s", sorted(self._assigned))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The next owner must find the outcomes of this worker's sends, not SENTs to redo;
        # another worker may write these deliveries now: what we remember may go stale.
        self._release("partitions revoked")
        self._assigned -= {p.partition for p in partitions}
        consumer.incremental_unassign(partitions)
        self._health.partitions = tuple(sorted(self._assigned))

    # -- one pass ------------------------------------------------------------------------------

    def read(self, wait: float) -> list[Item]:
        """Read what arrived (waiting up to ``wait`` seconds), open the deliveries of the
        SUCCEEDED executions in it and commit the position; the deliveries opened."""
        assert self._consumer is not None, "join() first"
        messages = self._consumer.consume(num_messages=OUTBOX_BATCH, timeout=wait)
        if messages:
            self._stall.arrived()
        else:
            self._check_stall()
        positions: dict[tuple[str, int], int] = {}
        succeeded: dict[str, str] = {}
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("outbox read: %s", error)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None:
                continue
            positions[(topic, partition)] = offset + 1
            event = self._decode_if_succeeded(message)
            if (
                isinstance(event, ExecutionTransitioned)
                and event.state is ExecutionState.SUCCEEDED
                and event.result_ref is not None
            ):
                succeeded[event.operation_id] = event.tenant_id
        fresh: list[Item] = []
        if succeeded:
            try:
                fresh = self._open_deliveries(succeeded)
            except BaseException:
                # Read, not acted on: read it again next pass, or its deliveries would open
                # only when some later reader starts from the committed offset.
                self._rewind(messages)
                raise
            fault_point("deliver.after_enqueue_before_commit")
        if positions:
            offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                # A rebalance took the partition: its next owner derives the same PENDINGs.
                log.info("outbox position not committed (%s); the next reader repeats it", exc)
        return fresh

    def _check_stall(self) -> None:
        """Nothing read for a while: ask the broker whether SUCCEEDED records wait beyond this
        worker's positions. If they do, its consumer stopped fetching (it says nothing): leave
        the group and join again, reading from the committed positions, as a restarted worker
        would; the deliveries of what was read twice are recognised, not opened again."""
        if self._consumer is None or not self._stall.look_due():
            return
        assignment = self._consumer.assignment()
        if not assignment:
            return
        behind = records_waiting(self._consumer, self._positions(assignment))
        if not behind:
            return
        log.warning(
            "delivery worker read nothing from its outbox for %.0fs while records wait on the "
            "broker (%s); leaving and joining its group again",
            self._stall.bound_s,
            listed(behind),
        )
        self._metrics.delivery_outbox_rejoins.inc()
        self._stall.remedied()
        self._release("rejoining the group")
        consumer, self._consumer = self._consumer, None
        consumer.close()
        self._assigned.clear()
        self._health.partitions = ()
        self.join()

    def _positions(self, assignment: list[TopicPartition]) -> dict[tuple[str, int], int]:
        """Where the outbox reads next on each assigned partition: the consumer's position, or,
        on a partition it has read nothing from since it was assigned longer than the bound
        ago, the committed offset (a partition just assigned may simply be starting)."""
        assert self._consumer is not None
        positions: dict[tuple[str, int], int] = {}
        unread: list[TopicPartition] = []
        settled = time.monotonic() - self._stall.bound_s
        for tp in self._consumer.position(assignment):
            if tp.offset >= 0:
                positions[(tp.topic, tp.partition)] = tp.offset
            elif self._assigned_at.get(tp.partition, settled) <= settled:
                unread.append(TopicPartition(tp.topic, tp.partition))
        if unread:
            try:
                for tp in self._consumer.committed(unread, timeout=2):
                    positions[(tp.topic, tp.partition)] = max(tp.offset, 0)
            except KafkaException:
                pass  # not asked about now: the next look tries again
        return positions

    def _rewind(self, messages: Sequence[Message]) -> None:
        """Seek each partition of ``messages`` back to its first record in them."""
        assert self._consumer is not None
        first: dict[tuple[str, int], int] = {}
        for message in messages:
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None or message.error():
                continue
            first.setdefault((topic, partition), offset)
        for (topic, partition), offset in first.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:  # revoked meanwhile: its next owner reads it
                log.info("outbox not rewound on %s[%d]: %s", topic, partition, exc)

    def _decode_if_succeeded(self, message: Message) -> Any:
        """The record's event if it may be a SUCCEEDED execution, else None. Two records of
        three on the execution topic are not (the intent, the dispatch): a peek at the state
        skips them unread; the rest are decoded and validated in full."""
        value = message.value()
        if value is None:
            return None
        peeked = self._codec.peek_state(value)
        if peeked is not None and peeked != _SUCCEEDED_EXECUTION:
            return None
        try:
            return self._codec.decode(value)
        except Exception:  # poison is the projector's to dead-letter; here it is only skipped
            return None

    def _open_deliveries(self, succeeded: dict[str, str]) -> list[Item]:
        snapshots = self._history.load(succeeded.items())
        executions = [
            s.execution
            for s in snapshots.values()
            # The fold may have refused the SUCCEEDED we read (fenced, a conflict).
            if s.execution is not None and s.execution.state is ExecutionState.SUCCEEDED
        ]
        configured = self._destinations.configured({(e.tenant_id, e.tool_name) for e in executions})
        events: list[DeliveryTransitioned] = []
        fresh: list[Item] = []
        for execution in executions:
            existing = snapshots[execution.operation_id].deliveries
            names = [
                n
                for n in configured.get((execution.tenant_id, execution.tool_name), ())
                if n not in existing
            ]
            for event in self._pendings(execution, names):
                outcome = apply_delivery(None, event, execution)
                if not isinstance(outcome, Applied):
                    log.error("outbox PENDING refused by the fold: %s", outcome)
                    continue
                events.append(event)
                fresh.append(Item(outcome.record, execution, []))
        self._records.append(events)
        self._metrics.outbox_deliveries.inc(len(events))
        for item in fresh:
            self._records.remember(item.record, item.execution)
        return fresh

    def _pendings(self, execution: ExecutionRecord, names: list[str]) -> list[DeliveryTransitioned]:
        """The outbox's PENDINGs for ``execution``, less any destination no event can name (a
        row the registry's checks did not see, written before them or by hand): that one is
        logged and counted, and every other destination, of this tenant and the others, goes
        on. Without this, one such row made every pass raise and the worker exit, for good."""
        try:
            return outbox_pendings(execution, names)
        except ValidationError:
            pass
        pendings: list[DeliveryTransitioned] = []
        for name in names:
            try:
                pendings.extend(outbox_pendings(execution, [name]))
            except ValidationError:
                self._outcomes.count("unrecordable", "refused")
                # The name is not logged: the contract refused it as credential-shaped or
                # malformed.
                log.error(
                    "tenant %s has a destination no delivery event can name (fix it in the "
                    "registry); %s is not delivered there",
                    execution.tenant_id,
                    execution.operation_id,
                )
        return pendings

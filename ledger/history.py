"""An operation's current state, exactly: the projection, then the tail of its partitions that the
projector has not folded yet (decision 005).

The projection alone lags the log by the projector's latency; the log alone would mean reading
whole partitions. Together they are exact and cheap: the projection's rows and the offsets they
were folded up to are read in one snapshot (they are committed in one transaction), and only the
records after those offsets are read from Kafka and folded with the same domain functions. A
record folded twice would be recognised as a duplicate (same event id) anyway.

Used by the SDK (``load``, ``take_over``) and the recovery worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition
from psycopg_pool import ConnectionPool

from ledger.codec import Codec, DecodeError, default_codec
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, OperationEvent
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    ExecutionRecord,
    apply_control,
    apply_delivery,
    apply_execution,
)
from ledger.kafka import partition_for
from ledger.log import LogUnavailableError, latest_offsets, new_consumer
from ledger.pg import retrying
from ledger.rows import DELIVERY_COLUMNS, OP_COLUMNS, columns, delivery_from_row, execution_from_row
from ledger.settings import Settings

#: How long a tail read may take before the reader gives up (the broker is away, say).
TAIL_TIMEOUT_S = 30.0


class HistoryError(RuntimeError):
    """The tail of the log could not be read: the broker did not answer in time, or its
    partitions' leadership did not settle within :data:`TAIL_TIMEOUT_S`."""


@dataclass(slots=True)
class Snapshot:
    """One operation as the log says it is now."""

    operation_id: str
    execution: ExecutionRecord | None = None
    deliveries: dict[str, DeliveryRecord] = field(default_factory=dict)


@dataclass(slots=True)
class View:
    """Snapshots of some operations, and the log position (exclusive, per topic and partition)
    they reflect."""

    snapshots: dict[str, Snapshot]
    tenants: dict[str, str]
    positions: dict[tuple[str, int], int]


def _fold_tail(
    snapshots: dict[str, Snapshot], tenants: Mapping[str, str], tail: Sequence[OperationEvent]
) -> None:
    # Executions (and the ownership changes and decisions ordered with them) first, as the
    # projector folds: nothing on the execution topic depends on a delivery.
    for event in sorted(tail, key=lambda e: e.kind == "delivery"):
        snapshot = snapshots[event.operation_id]
        if event.tenant_id != tenants[event.operation_id]:
            continue  # another tenant's event for this id: never part of this view
        outcome: Any
        if isinstance(event, ExecutionTransitioned):
            outcome = apply_execution(snapshot.execution, event)
        elif isinstance(event, DeliveryTransitioned):
            current = snapshot.deliveries.get(event.destination)
            outcome = apply_delivery(current, event, snapshot.execution)
            if isinstance(outcome, Applied):
                snapshot.deliveries[event.destination] = outcome.record
            continue
        else:
            outcome = apply_control(snapshot.execution, event)
        if isinstance(outcome, Applied):
            snapshot.execution = outcome.record


class HistoryReader:
    """Reads operations' exact current state (projection + unfolded tail)."""

    def __init__(
        self,
        settings: Settings,
        pool: ConnectionPool[Any],
        *,
        codec: Codec | None = None,
        client_id: str = "opledger-history",
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._codec = codec or default_codec()
        self._client_id = client_id
        self._consumer: Consumer | None = None

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def load(
        self,
        operations: Iterable[tuple[str, str]],
        *,
        upto: Mapping[tuple[str, int], int] | None = None,
    ) -> dict[str, Snapshot]:
        """The state of each ``(operation_id, tenant_id)``, read up to ``upto`` (exclusive end
        offset per (topic, partition); default: the partitions' current ends). An operation
        another tenant owns reads as empty: no execution, no deliveries."""
        return self.view(operations, upto=upto).snapshots

    def view(
        self,
        operations: Iterable[tuple[str, str]],
        *,
        upto: Mapping[tuple[str, int], int] | None = None,
    ) -> View:
        """:meth:`load`, with the log position each partition was read up to, so that a later
        :meth:`advance` reads only what came after."""
        pairs = list(operations)
        if not pairs:
            return View({}, {}, {})
        tenants = dict(pairs)
        count = self._settings.partitions
        partitions = {partition_for(op.encode(), count) for op in tenants}
        topics = (self._settings.execution_topic, self._settings.delivery_topic)
        snapshots, projected = self._projected(pairs, topics, partitions)
        start = {(t, p): projected.get((t, p), 0) for t in topics for p in partitions}
        tail, reached = self._tail(start, set(tenants), upto)
        _fold_tail(snapshots, tenants, tail)
        return View(snapshots, tenants, reached)

    def advance(
        self,
        view: View,
        operations: Iterable[str],
        *,
        upto: Mapping[tuple[str, int], int] | None = None,
    ) -> dict[str, Snapshot]:
        """``operations`` (ids of ``view``) as :meth:`load` would read them up to ``upto`` now,
        from the view's snapshots and only the records after its positions: no projection
        read. The view's snapshots of them are moved on in place."""
        wanted = {op: view.tenants[op] for op in operations}
        if not wanted:
            return {}
        count = self._settings.partitions
        partitions = {partition_for(op.encode(), count) for op in wanted}
        start = {key: offset for key, offset in view.positions.items() if key[1] in partitions}
        tail, reached = self._tail(start, set(wanted), upto)
        snapshots = {op: view.snapshots[op] for op in wanted}
        _fold_tail(snapshots, wanted, tail)
        view.positions.update(reached)
        return snapshots

    def _projected(
        self, pairs: Sequence[tuple[str, str]], topics: Sequence[str], partitions: set[int]
    ) -> tuple[dict[str, Snapshot], dict[tuple[str, int], int]]:
        ops = [p[0] for p in pairs]
        tenants = [p[1] for p in pairs]

        def work(
            conn: psycopg.Connection[Any],
        ) -> tuple[list[Any], list[Any], list[Any]]:
            # One snapshot: the rows and the offsets they were folded up to were committed
            # together, so they are read together.
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                rows = conn.execute(
                    f"SELECT {columns(OP_COLUMNS)} FROM agent_operations o "
                    "JOIN unnest(%s::text[], %s::text[]) AS x(op, tenant) "
                    "ON o.operation_id = x.op AND o.tenant_id = x.tenant",
                    (ops, tenants),
                ).fetchall()
                deliveries = conn.execute(
                    f"SELECT {columns(DELIVERY_COLUMNS)} FROM deliveries d "
                    "JOIN unnest(%s::text[], %s::text[]) AS x(op, tenant) "
                    "ON d.operation_id = x.op AND d.tenant_id = x.tenant",
                    (ops, tenants),
                ).fetchall()
                offsets = conn.execute(
                    "SELECT topic, partition, next_offset FROM projector_offsets "
                    "WHERE consumer = %s AND topic = ANY(%s) AND partition = ANY(%s)",
                    (self._settings.projector_group, list(topics), sorted(partitions)),
                ).fetchall()
            return rows, deliveries, offsets

        rows, delivery_rows, offset_rows = retrying(self._pool, "read operations", work)
        snapshots = {op: Snapshot(op) for op in ops}
        for row in rows:
            snapshots[row[0]].execution = execution_from_row(row)
        for row in delivery_rows:
            record = delivery_from_row(row)
            snapshots[record.operation_id].deliveries[record.destination] = record
        return snapshots, {(t, p): int(n) for t, p, n in offset_rows}

    def _tail(
        self,
        start: Mapping[tuple[str, int], int],
        wanted: set[str],
        upto: Mapping[tuple[str, int], int] | None,
    ) -> tuple[list[OperationEvent], dict[tuple[str, int], int]]:
        """The events of ``wanted`` from ``start`` to ``upto`` (default: the ends), and the
        position each partition was read up to."""
        consumer = self._open()
        try:
            deadline = time.monotonic() + TAIL_TIMEOUT_S
            latest = latest_offsets(
                consumer,
                [key for key in start if upto is None or upto.get(key) is None],
                deadline,
                bootstrap=self._settings.bootstrap_servers,
            )
            ends: dict[tuple[str, int], int] = {}
            reached = dict(start)
            for key, begin in start.items():
                end = upto.get(key) if upto is not None else None
                if end is None:
                    end = latest[key]
                if end > begin:
                    ends[key] = reached[key] = end
            if not ends:
                return [], reached
            consumer.assign([TopicPartition(t, p, start[(t, p)]) for (t, p) in ends])
            keys = {op.encode() for op in wanted}
            events: list[OperationEvent] = []
            remaining = dict(ends)
            # consume(n, timeout) returns early only once n records arrived: asking for no
            # more than the tail still holds returns as soon as it is read, instead of waiting
            # out the timeout on every call (0.2 s under every load with a short tail).
            unread = sum(end - start[key] for key, end in ends.items())
            while remaining:
                if time.monotonic() > deadline:
                    raise HistoryError(f"the log's tail was not read within {TAIL_TIMEOUT_S}s")
                batch = consumer.consume(max(1, min(1000, unread)), 0.2)
                unread -= len(batch)
                for message in batch:
                    if message.error() is not None:
                        # A fetch error (a leader moving) is the client's to retry; the
                        # records come once it has; the deadline bounds the wait.
                        continue
                    key = (str(message.topic()), int(message.partition() or 0))
                    offset = int(message.offset() or 0)
                    end = remaining.get(key)
                    if end is None or offset >= end:
                        continue
                    if offset == end - 1:
                        del remaining[key]
                    key_bytes = message.key()
                    if key_bytes not in keys:
                        continue
                    try:
                        event = self._codec.decode_operation(message.value() or b"")
                    except DecodeError:
                        continue  # the projector dead-letters it; it is no part of any state
                    if event.operation_id.encode() != key_bytes:
                        # Keyed by one operation, carrying another's event: the projector
                        # dead-letters it, so it is no part of either operation's state.
                        continue
                    events.append(event)
            return events, reached
        except LogUnavailableError as exc:
            raise HistoryError(f"the log's tail could not be read: {exc}") from exc
        except KafkaException as exc:
            raise HistoryError(
                f"the log's tail could not be read from {self._settings.bootstrap_servers}: "
                f"{exc}; nothing was changed, ask again"
            ) from exc
        finally:
            consumer.unassign()

    def _open(self) -> Consumer:
        if self._consumer is None:
            self._consumer = new_consumer(
                self._settings,
                group_id=self._settings.readers_group(self._client_id),
                client_id=self._client_id,
            )
        return self._consumer

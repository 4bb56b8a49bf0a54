"""Folds event batches into the projection tables, exactly once.

One PostgreSQL transaction per batch holds: the history rows, the anomalies, the new and changed
current-state rows, and the consumed offsets (pyeventsourcing's tracking table). Kafka's own
offset commit happens after it and is informational only, so every crash point is safe:

- crash before COMMIT: nothing is stored; Kafka redelivers from the stored offset and the batch is
  folded again from the same starting rows.
- crash after COMMIT: the offsets moved with the rows; redelivered records are below the stored
  offset and are skipped (counted as ``skipped_redelivered``), never applied twice.

Writes are COPY-based (one round trip per table per batch, not per event); updates go through a
staged COPY and one guarded UPDATE whose row count must match, as DBOS guards state changes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from ledger import pg
from ledger.domain.events import (
    DeliveryTransitioned,
    ExecutionTransitioned,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    Duplicate,
    ExecutionRecord,
    Rejected,
    RejectionKind,
    apply_control,
    apply_delivery,
    apply_execution,
)
from ledger.domain.policy import PolicyChange
from ledger.pg import LOCK_TIMEOUT_MS
from ledger.records import (
    Coordinates,
    DeadLetter,
    OpenAges,
    ProjectionBatch,
    ProjectionReport,
    RecordRefusedError,
    SinkUnavailableError,
    SourcedEvent,
    SourcedPolicyChange,
)
from ledger.rows import (
    DELIVERY_COLUMNS,
    OP_COLUMNS,
    columns,
    delivery_from_row,
    delivery_row,
    execution_from_row,
    execution_row,
)
from projections.schema import apply_migrations

_OP_COLUMNS = OP_COLUMNS
#: New rows also get the partition the operation lives on (the recovery worker's unit of work).
_OP_INSERT_COLUMNS = (*OP_COLUMNS, "kafka_partition")
_DELIVERY_COLUMNS = DELIVERY_COLUMNS
_HISTORY_COLUMNS = (
    "topic",
    "partition",
    "offset",
    "event_id",
    "operation_id",
    "tenant_id",
    "actor_id",
    "machine",
    "destination",
    "state",
    "attempt",
    "outcome",
    "provider_ref",
    "result_ref",
    "error",
    "occurred_at",
    "next_attempt_at",
)


#: Operations whose current rows a projection keeps in memory between batches (about 3 KB each
#: with their deliveries: ~64 MB at most).
ROW_CACHE_LIMIT = 20_000

_Row = TypeVar("_Row")


class _RowCache(Generic[_Row]):
    """The current rows of recently folded operations, as this projection last committed them.

    Loading and parsing the rows a batch touches was the largest cost of a batch after decoding
    (a fifth of the projector's CPU with the delivery worker running), and almost every event is
    about an operation the previous batches just wrote. Entries are put only after their batch
    committed, and the whole cache is dropped whenever its rows may have been written by anyone
    else (:meth:`PostgresProjection._check_positions`) or a batch failed, so a batch folds from
    the same starting rows it would have read. Only rows that exist are kept: an operation with
    none is always asked of the database, so a stale entry could only fail a guarded UPDATE
    (retried from the database), never clash with a row someone else inserted.
    """

    __slots__ = ("_limit", "_rows")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._rows: dict[str, _Row] = {}

    def get(self, operation_id: str) -> _Row | None:
        return self._rows.get(operation_id)

    def put(self, operation_id: str, row: _Row) -> None:
        rows = self._rows
        rows.pop(operation_id, None)  # re-inserted last: the oldest entries go first
        rows[operation_id] = row
        if len(rows) > self._limit:
            for stale in list(itertools.islice(rows, len(rows) - self._limit)):
                del rows[stale]

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)


class ProjectionConflictError(SinkUnavailableError):
    """A guarded update touched fewer rows than folded: another writer changed the same rows.

    The transaction is rolled back and the batch is folded again from the stored state.
    """


# Errors that say the *data* cannot be stored (a value PostgreSQL refuses, a constraint, a value
# the driver cannot convert), as opposed to the database being unreachable: the batch holding
# it would fail every time, so the reader isolates the record instead of retrying.
_REFUSALS: tuple[type[BaseException], ...] = (
    psycopg.DataError,
    psycopg.IntegrityError,
    psycopg.errors.InternalError_,
    ValueError,
    TypeError,
    OverflowError,
    UnicodeError,
)
# A lock timeout (LockNotAvailable) is an OperationalError too: a batch that waited too long is
# tried again, never split and dead-lettered.
_UNAVAILABLE: tuple[type[BaseException], ...] = (psycopg.OperationalError, psycopg.InterfaceError)

_ANOMALY_COLUMNS = (
    "topic",
    "partition",
    "offset",
    "operation_id",
    "tenant_id",
    "machine",
    "reason",
    "event",
    "kind",
    "source_tenant_id",
)
_DEAD_LETTER_COLUMNS = ("topic", "partition", "offset", "reason", "size_bytes", "by_reference")


def storable(text: str, limit: int = 2000) -> str:
    """``text`` as something PostgreSQL can hold: no NUL, no lone surrogates, bounded."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()[:limit]


def _cols(names: Iterable[str]) -> str:
    return columns(names)


def _history_row(item: SourcedEvent, outcome: str) -> tuple[Any, ...]:
    c, e = item.coordinates, item.event
    destination = provider_ref = result_ref = error = next_attempt_at = None
    if isinstance(e, ExecutionTransitioned):
        machine, state = "execution", e.state._value_
        provider_ref, result_ref, error = e.provider_ref, e.result_ref, e.error
    elif isinstance(e, DeliveryTransitioned):
        machine, state, destination = "delivery", e.state._value_, e.destination
        result_ref, error, next_attempt_at = e.result_ref, e.error, e.next_attempt_at
    elif isinstance(e, OwnershipTaken):
        machine, state, error = "control", "OWNERSHIP_TAKEN", e.reason
    else:
        machine, state = "control", f"DECISION:{e.decision._value_}"
        provider_ref, result_ref, error = e.provider_ref, e.result_ref, e.reason
    return (
        c.topic,
        c.partition,
        c.offset,
        e.event_id,
        e.operation_id,
        e.tenant_id,
        e.actor_id,
        machine,
        destination,
        state,
        e.attempt,
        outcome,
        provider_ref,
        result_ref,
        error,
        e.occurred_at,
        next_attempt_at,
    )


_RECONCILIATION_COLUMNS = (
    "topic",
    "partition",
    "offset",
    "event_id",
    "operation_id",
    "tenant_id",
    "actor_id",
    "attempt",
    "decision",
    "lookup",
    "provider_ref",
    "result_ref",
    "policy_version",
    "policy_allowed",
    "lease_token",
    "reason",
    "occurred_at",
)


def _reconciliation_row(item: SourcedEvent) -> tuple[Any, ...]:
    c, e = item.coordinates, item.event
    assert isinstance(e, ReconciliationDecided)
    return (
        c.topic,
        c.partition,
        c.offset,
        e.event_id,
        e.operation_id,
        e.tenant_id,
        e.actor_id,
        e.attempt,
        e.decision._value_,
        e.lookup._value_,
        e.provider_ref,
        e.result_ref,
        e.policy_version,
        e.policy_allowed,
        e.lease_token,
        e.reason,
        e.occurred_at,
    )


def _read(positions: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """The partitions something was read from: a stored offset of 0 (the row a batch inserts
    for a partition it reads first) says the same as no row, so it does not make the cache
    look stale."""
    return {key: offset for key, offset in positions.items() if offset}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return storable(text.splitlines()[0] if text else type(exc).__name__, 500)


def _held_back(coordinates: Any, held: dict[tuple[str, int], int]) -> bool:
    offset = held.get((coordinates.topic, coordinates.partition))
    return offset is not None and coordinates.offset >= offset


def _dead_row(d: DeadLetter) -> tuple[Any, ...]:
    c = d.coordinates
    size = len(d.value or b"") if d.size_bytes is None else d.size_bytes
    return (c.topic, c.partition, c.offset, storable(d.reason), size, d.by_reference)


class _Folded:
    """What folding one batch produced, ready to write."""

    def __init__(self) -> None:
        self.history: list[tuple[Any, ...]] = []
        self.anomalies: list[tuple[Any, ...]] = []
        self.operations: dict[str, tuple[ExecutionRecord, int, str | None]] = {}
        self.deliveries: dict[tuple[str, str], tuple[DeliveryRecord, int, str | None]] = {}
        #: (delivery topic, partition) -> first offset held back for a later batch
        self.held: dict[tuple[str, int], int] = {}
        #: operation id -> the partition its execution events are on (for new rows)
        self.partitions: dict[str, int] = {}
        self.reconciliations: list[tuple[Any, ...]] = []
        #: every current row of the operations the batch touched, once it is folded
        self.current_operations: dict[str, ExecutionRecord] = {}
        self.current_deliveries: dict[str, dict[str, DeliveryRecord]] = {}

    def record(
        self,
        item: SourcedEvent,
        machine: str,
        outcome: Any,
        owner_tenant: str,
        report: ProjectionReport,
    ) -> None:
        if isinstance(outcome, Applied):
            report.applied[machine] += 1
            self.history.append(_history_row(item, "applied"))
            return
        if isinstance(outcome, Duplicate):
            report.duplicates[machine] += 1
            self.history.append(_history_row(item, "duplicate"))
            return
        report.anomalies[machine] += 1
        report.anomaly_kinds[(machine, outcome.kind.value)] += 1
        self.history.append(_history_row(item, "anomaly"))
        event, c = item.event, item.coordinates
        # The anomaly belongs to the operation's owner, who sees the reason; the tenant that
        # sent a foreign event is kept apart (source_tenant_id) for operators only.
        foreign = event.tenant_id if event.tenant_id != owner_tenant else None
        self.anomalies.append(
            (
                c.topic,
                c.partition,
                c.offset,
                event.operation_id,
                owner_tenant,
                machine,
                outcome.reason,
                Jsonb(event.model_dump(mode="json")),
                outcome.kind.value,
                foreign,
            )
        )


def _open_session(dsn: str) -> psycopg.Connection[Any]:
    """The projector's session. Its lock waits are unbounded at first: the migrations that
    follow a start queue on their lock behind a concurrent starter's (the bound is set once
    they are done, :meth:`PostgresProjection._bound_lock_waits`)."""
    return pg.connect(dsn, name="opledger-projector", lock_timeout_ms=None)


class PostgresProjection:
    """The :class:`ledger.records.ProjectionSink` over PostgreSQL."""

    def __init__(
        self, conn: psycopg.Connection[Any], dsn: str = "", *, lock_timeout_ms: int = 0
    ) -> None:
        self._conn = conn
        self._lock_timeout_ms = lock_timeout_ms
        # psycopg's dsn leaves the password out: pass the real one to survive a reconnect.
        self._dsn = dsn or conn.info.dsn
        self._consumer = ""
        self._staging_ready = False
        self._types: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        self._operations: _RowCache[ExecutionRecord] = _RowCache(ROW_CACHE_LIMIT)
        #: operation id -> every delivery row of that operation
        self._deliveries: _RowCache[dict[str, DeliveryRecord]] = _RowCache(ROW_CACHE_LIMIT)
        #: this consumer's stored offsets as of this projection's last commit; None: unknown
        self._positions: dict[tuple[str, int], int] | None = None

    @classmethod
    def connect(cls, dsn: str, *, lock_timeout_ms: int = LOCK_TIMEOUT_MS) -> PostgresProjection:
        try:
            conn = _open_session(dsn)
        except psycopg.OperationalError as exc:
            raise SinkUnavailableError(f"PostgreSQL unreachable: {_first_line(exc)}") from exc
        projection = cls(conn, dsn, lock_timeout_ms=lock_timeout_ms)
        projection.migrate()  # unbounded: concurrent starters queue on the migrations' lock
        projection._bound_lock_waits(conn)
        return projection

    def _bound_lock_waits(self, conn: psycopg.Connection[Any]) -> None:
        """A lock another session holds on a projection table (an analyst's ``LOCK TABLE``, a
        transaction left open) would make a batch wait for ever, the projector silent: past
        the bound the batch is paused and tried again, and /healthz says why."""
        try:
            conn.execute(f"SET lock_timeout = {int(self._lock_timeout_ms)}")
        except psycopg.Error as exc:
            raise SinkUnavailableError(f"PostgreSQL unavailable: {_first_line(exc)}") from exc

    def close(self) -> None:
        self._conn.close()

    def migrate(self) -> list[int]:
        return apply_migrations(self._conn)

    def _ensure_staging(self) -> None:
        if self._staging_ready:
            return
        # Session-local staging tables for the guarded UPDATEs; emptied at every commit.
        self._conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS stage_operations "
            "(LIKE agent_operations, prev_version INTEGER, prev_state TEXT) ON COMMIT DELETE ROWS"
        )
        self._conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS stage_deliveries "
            "(LIKE deliveries, prev_version INTEGER, prev_state TEXT) ON COMMIT DELETE ROWS"
        )
        self._staging_ready = True

    def positions(self, consumer: str, topics: Sequence[str]) -> dict[tuple[str, int], int]:
        try:
            rows = self._conn.execute(
                "SELECT topic, partition, next_offset FROM projector_offsets "
                "WHERE consumer = %s AND topic = ANY(%s)",
                (consumer, list(topics)),
            ).fetchall()
        except _UNAVAILABLE as exc:
            raise SinkUnavailableError(f"PostgreSQL unavailable: {_first_line(exc)}") from exc
        return {(t, p): n for t, p, n in rows}

    def open_ages(self) -> OpenAges:
        # Both queries read the partial indexes on unfinished rows (migration 002), so they stay
        # cheap however many finished operations the tables hold.
        executions = self._conn.execute(
            "SELECT execution_state, extract(epoch FROM now() - min(state_entered_at)) "
            "FROM agent_operations "
            "WHERE execution_state IN ('INTENT_RECORDED', 'DISPATCHED', 'UNKNOWN') "
            "GROUP BY execution_state"
        ).fetchall()
        deliveries = self._conn.execute(
            "SELECT destination, state, extract(epoch FROM now() - min(state_entered_at)) "
            "FROM deliveries WHERE state IN ('PENDING', 'SENT') GROUP BY destination, state"
        ).fetchall()
        return OpenAges(
            executions={state: float(age) for state, age in executions},
            deliveries={(dest, state): float(age) for dest, state, age in deliveries},
        )

    def reconnect(self) -> None:
        """Replace the connection (after PostgreSQL went away); raises SinkUnavailableError."""
        try:
            conn = _open_session(self._dsn)
        except psycopg.Error as exc:
            raise SinkUnavailableError(f"PostgreSQL unreachable: {_first_line(exc)}") from exc
        self._bound_lock_waits(conn)
        old, self._conn = self._conn, conn
        self._staging_ready = False  # temp tables live and die with the session
        self._forget()
        with contextlib.suppress(Exception):
            old.close()

    def project(self, consumer: str, batch: ProjectionBatch) -> ProjectionReport:
        """Fold the batch and commit rows and offsets in one transaction.

        Raises :class:`SinkUnavailableError` when the database is unreachable (nothing stored;
        try the same batch again) and :class:`RecordRefusedError` when something in the batch
        cannot be stored (nothing stored; the caller isolates the record).
        """
        try:
            return self._project(consumer, batch)
        except BaseException as exc:
            # Rolled back, or committed without an answer: the cached rows may not be the
            # stored ones.
            self._forget()
            if isinstance(exc, SinkUnavailableError):
                raise
            if isinstance(exc, _UNAVAILABLE):
                raise SinkUnavailableError(f"PostgreSQL unavailable: {_first_line(exc)}") from exc
            if isinstance(exc, _REFUSALS):
                raise RecordRefusedError(f"{type(exc).__name__}: {_first_line(exc)}") from exc
            raise

    def _forget(self) -> None:
        self._operations.clear()
        self._deliveries.clear()
        self._positions = None

    def _check_positions(
        self, cur: psycopg.Cursor[Any], consumer: str
    ) -> dict[tuple[str, int], int]:
        """This consumer's stored offsets; drops the cached rows unless they are exactly the ones
        this projection committed last (anyone else's commit, a projector sharing the consumer
        name or one that had these partitions meanwhile, moves some offset)."""
        cur.execute(
            "SELECT topic, partition, next_offset FROM projector_offsets WHERE consumer = %s",
            (consumer,),
        )
        positions = {(t, p): n for t, p, n in cur.fetchall()}
        if self._positions is None or _read(positions) != _read(self._positions):
            self._operations.clear()
            self._deliveries.clear()
        return positions

    def _project(self, consumer: str, batch: ProjectionBatch) -> ProjectionReport:
        self._ensure_staging()
        report = ProjectionReport()
        if not batch.next_offsets:
            return report
        self._consumer = consumer
        with self._conn.transaction(), self._conn.cursor() as cur:
            stored = self._lock_offsets(cur, consumer, batch)
            positions = self._check_positions(cur, consumer)
            fresh = [
                e
                for e in batch.events
                if e.coordinates.offset >= stored[(e.coordinates.topic, e.coordinates.partition)]
            ]
            dead = [
                d
                for d in batch.dead_letters
                if d.coordinates.offset >= stored[(d.coordinates.topic, d.coordinates.partition)]
            ]
            policy = [
                p
                for p in batch.policy_changes
                if p.coordinates.offset >= stored[(p.coordinates.topic, p.coordinates.partition)]
            ]
            report.skipped_redelivered = (
                len(batch.events)
                + len(batch.dead_letters)
                + len(batch.policy_changes)
                - len(fresh)
                - len(dead)
                - len(policy)
            )
            folded = self._fold(cur, fresh, report, batch, stored)
            next_offsets = dict(batch.next_offsets)
            for key, offset in folded.held.items():
                # Held deliveries and everything after them on their partition are read again.
                next_offsets[key] = offset
                report.rewind[key] = offset
            dead = [d for d in dead if not _held_back(d.coordinates, folded.held)]
            self._copy(cur, "operation_history", _HISTORY_COLUMNS, folded.history)
            self._copy(cur, "anomalies", _ANOMALY_COLUMNS, folded.anomalies)
            self._copy(cur, "reconciliations", _RECONCILIATION_COLUMNS, folded.reconciliations)
            self._copy(cur, "dead_letters", _DEAD_LETTER_COLUMNS, [_dead_row(d) for d in dead])
            report.dead_letters = len(dead)
            if policy:
                report.policy_stale = _write_policy(cur, policy)
                report.policy_changes = len(policy) - len(report.policy_stale)
            self._write_current(
                cur,
                table="agent_operations",
                stage="stage_operations",
                columns=_OP_COLUMNS,
                state_column="execution_state",
                changed=folded.operations,
                partitions=folded.partitions,
            )
            self._write_current(
                cur,
                table="deliveries",
                stage="stage_deliveries",
                columns=_DELIVERY_COLUMNS,
                state_column="state",
                changed=folded.deliveries,
            )
            cur.execute(
                "UPDATE projector_offsets o SET next_offset = x.n, updated_at = now() "
                "FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS x(t, p, n) "
                "WHERE o.consumer = %s AND o.topic = x.t AND o.partition = x.p "
                "AND o.next_offset < x.n",
                (
                    [t for t, _ in next_offsets],
                    [p for _, p in next_offsets],
                    list(next_offsets.values()),
                    consumer,
                ),
            )
        # Committed: these are now the stored rows and offsets.
        for key, offset in next_offsets.items():
            positions[key] = max(offset, positions.get(key, stored.get(key, 0)))
        self._positions = positions
        for operation_id, record in folded.current_operations.items():
            self._operations.put(operation_id, record)
        for operation_id, rows in folded.current_deliveries.items():
            self._deliveries.put(operation_id, rows)
        return report

    def _lock_offsets(
        self, cur: psycopg.Cursor[Any], consumer: str, batch: ProjectionBatch
    ) -> dict[tuple[str, int], int]:
        topics = [t for t, _ in batch.next_offsets]
        parts = [p for _, p in batch.next_offsets]
        cur.execute(
            "INSERT INTO projector_offsets (consumer, topic, partition, next_offset) "
            "SELECT %s, t, p, 0 FROM unnest(%s::text[], %s::int[]) AS x(t, p) "
            "ON CONFLICT DO NOTHING",
            (consumer, topics, parts),
        )
        # FOR UPDATE serialises two projectors that share a consumer name (a zombie and its
        # replacement): the second waits, then sees the advanced offsets and skips the batch.
        cur.execute(
            "SELECT o.topic, o.partition, o.next_offset FROM projector_offsets o "
            "JOIN unnest(%s::text[], %s::int[]) AS x(t, p) ON o.topic = x.t AND o.partition = x.p "
            "WHERE o.consumer = %s ORDER BY o.topic, o.partition FOR UPDATE OF o",
            (topics, parts, consumer),
        )
        return {(t, p): n for t, p, n in cur.fetchall()}

    def _execution_settled(
        self,
        cur: psycopg.Cursor[Any],
        batch: ProjectionBatch,
        stored: dict[tuple[str, int], int],
        partition: int,
    ) -> bool:
        """Whether partition ``partition`` of the execution topic is projected (with this batch)
        up to its current end, so that a delivery there still finding no SUCCEEDED execution
        will never find one."""
        if batch.execution_end is None:
            return True  # a caller that cannot ask the broker: judge on what is projected
        key = (batch.execution_topic, partition)
        position = batch.next_offsets.get(key, stored.get(key))
        if position is None:
            cur.execute(
                "SELECT next_offset FROM projector_offsets "
                "WHERE consumer = %s AND topic = %s AND partition = %s",
                (self._consumer, batch.execution_topic, partition),
            )
            row = cur.fetchone()
            position = 0 if row is None else int(row[0])
        return position >= batch.execution_end(partition)

    def _fold(
        self,
        cur: psycopg.Cursor[Any],
        fresh: Sequence[SourcedEvent],
        report: ProjectionReport,
        batch: ProjectionBatch,
        stored: dict[tuple[str, int], int],
    ) -> _Folded:
        delivery_ids = {
            e.event.operation_id for e in fresh if isinstance(e.event, DeliveryTransitioned)
        }
        # A delivery is checked against its execution, so the execution row is loaded for it too.
        ops = self._load_operations(cur, {e.event.operation_id for e in fresh})
        deliveries = self._load_deliveries(cur, delivery_ids)
        # (version as loaded, state as loaded): the guard of the UPDATE.
        op_start = {k: (v.version, v.state.value) for k, v in ops.items()}
        delivery_start = {k: (v.version, v.state.value) for k, v in deliveries.items()}
        folded = _Folded()
        # Executions first: nothing on the execution topic depends on a delivery, and a delivery
        # fetched in the same batch as the execution it follows must see that execution.
        # Ownership changes and decisions travel with the transitions, in their log order.
        for item in fresh:
            event = item.event
            if isinstance(event, DeliveryTransitioned):
                continue
            current = ops.get(event.operation_id)
            outcome: Any
            if isinstance(event, ExecutionTransitioned):
                machine = "execution"
                outcome = apply_execution(current, event)
                folded.partitions.setdefault(event.operation_id, item.coordinates.partition)
            else:
                machine = "control"
                outcome = apply_control(current, event)
            if isinstance(outcome, Applied):
                ops[event.operation_id] = outcome.record
                if isinstance(event, ReconciliationDecided):
                    folded.reconciliations.append(_reconciliation_row(item))
            owner = event.tenant_id if current is None else current.tenant_id
            folded.record(item, machine, outcome, owner, report)
        settled: dict[int, bool] = {}
        for item in fresh:
            event = item.event
            if not isinstance(event, DeliveryTransitioned):
                continue
            partition = item.coordinates.partition
            key = (item.coordinates.topic, partition)
            if key in folded.held:
                continue
            execution = ops.get(event.operation_id)
            dkey = (event.operation_id, event.destination)
            outcome = apply_delivery(deliveries.get(dkey), event, execution)
            if isinstance(outcome, Rejected) and outcome.kind is RejectionKind.AWAITING_EXECUTION:
                if partition not in settled:
                    settled[partition] = self._execution_settled(cur, batch, stored, partition)
                if not settled[partition]:
                    folded.held[key] = item.coordinates.offset
                    continue
            if isinstance(outcome, Applied):
                previous = deliveries.get(dkey)
                if previous is not None and outcome.record.redrives > previous.redrives:
                    report.redrives += 1
                deliveries[dkey] = outcome.record
            owner = event.tenant_id if execution is None else execution.tenant_id
            folded.record(item, "delivery", outcome, owner, report)
        folded.current_operations = ops
        by_operation: dict[str, dict[str, DeliveryRecord]] = {}
        for (operation_id, destination), record in deliveries.items():
            by_operation.setdefault(operation_id, {})[destination] = record
        folded.current_deliveries = by_operation
        folded.operations = {
            k: (r, *op_start.get(k, (0, None)))
            for k, r in ops.items()
            if r.version != op_start.get(k, (0, None))[0]
        }
        folded.deliveries = {
            k: (r, *delivery_start.get(k, (0, None)))
            for k, r in deliveries.items()
            if r.version != delivery_start.get(k, (0, None))[0]
        }
        return folded

    def _load_operations(
        self, cur: psycopg.Cursor[Any], ids: set[str]
    ) -> dict[str, ExecutionRecord]:
        found: dict[str, ExecutionRecord] = {}
        missing = []
        cached = self._operations.get
        for operation_id in ids:
            record = cached(operation_id)
            if record is None:
                missing.append(operation_id)
            else:
                found[operation_id] = record
        if missing:
            cur.execute(
                f"SELECT {_cols(_OP_COLUMNS)} FROM agent_operations WHERE operation_id = ANY(%s)",
                (missing,),
            )
            for row in cur.fetchall():
                found[row[0]] = execution_from_row(row)
        return found

    def _load_deliveries(
        self, cur: psycopg.Cursor[Any], ids: set[str]
    ) -> dict[tuple[str, str], DeliveryRecord]:
        found: dict[tuple[str, str], DeliveryRecord] = {}
        missing = []
        cached = self._deliveries.get
        for operation_id in ids:
            rows = cached(operation_id)
            if rows is None:
                missing.append(operation_id)
            else:
                for destination, record in rows.items():
                    found[(operation_id, destination)] = record
        if missing:
            cur.execute(
                f"SELECT {_cols(_DELIVERY_COLUMNS)} FROM deliveries WHERE operation_id = ANY(%s)",
                (missing,),
            )
            for row in cur.fetchall():
                found[(row[0], row[1])] = delivery_from_row(row)
        return found

    def _copy(
        self,
        cur: psycopg.Cursor[Any],
        table: str,
        columns: Sequence[str],
        rows: Sequence[tuple[Any, ...]],
    ) -> None:
        if not rows:
            return
        # Binary COPY: no text formatting of every value on our side and no parsing on the
        # server's; the column types come from the catalogue, so the rows stored are the same.
        types = self._column_types(cur, table, columns)
        with cur.copy(f"COPY {table} ({_cols(columns)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row(row)

    def _column_types(
        self, cur: psycopg.Cursor[Any], table: str, columns: Sequence[str]
    ) -> list[int]:
        """Type OIDs of ``columns`` (cached: tables and staging tables live as long as the
        connection, and migrations run before the first batch)."""
        key = (table, tuple(columns))
        types = self._types.get(key)
        if types is None:
            cur.execute(
                "SELECT attname, atttypid::int FROM pg_attribute "
                "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
                (table,),
            )
            by_name = dict(cur.fetchall())
            types = self._types[key] = [by_name[c] for c in columns]
        return types

    def _write_current(
        self,
        cur: psycopg.Cursor[Any],
        *,
        table: str,
        stage: str,
        columns: Sequence[str],
        state_column: str,
        changed: dict[Any, tuple[Any, int, str | None]],
        partitions: dict[str, int] | None = None,
    ) -> None:
        partitions = partitions or {}
        operations = table == "agent_operations"
        new_rows: list[tuple[Any, ...]] = []
        updates: list[tuple[Any, ...]] = []
        for key, (r, version, state) in changed.items():
            row = execution_row(r) if operations else delivery_row(r)
            if version:
                updates.append((*row, version, state))
            elif operations:
                new_rows.append((*row, partitions.get(key)))
            else:
                new_rows.append(row)
        # New rows go straight in: their key's partition is owned by this transaction (offset
        # rows are locked), so a primary-key clash means a second writer, and must fail loudly.
        self._copy(cur, table, _OP_INSERT_COLUMNS if operations else columns, new_rows)
        if not updates:
            return
        self._copy(cur, stage, (*columns, "prev_version", "prev_state"), updates)
        keys = ("operation_id",) if table == "agent_operations" else ("operation_id", "destination")
        assignments = ", ".join(f'"{c}" = s."{c}"' for c in columns if c not in keys)
        join = " AND ".join(f't."{k}" = s."{k}"' for k in keys)
        cur.execute(
            f"UPDATE {table} t SET {assignments} FROM {stage} s WHERE {join} "
            f"AND t.version = s.prev_version AND t.{state_column} = s.prev_state"
        )
        if cur.rowcount != len(updates):
            raise ProjectionConflictError(
                f"{table}: guarded update changed {cur.rowcount} of {len(updates)} rows"
            )


# -- policy ----------------------------------------------------------------------------------------

_POLICY_HISTORY_COLUMNS = (
    "topic",
    "partition",
    "offset",
    "event_id",
    "tenant_id",
    "actor_id",
    "change",
    "principal",
    "tool_name",
    "destinations",
    "repeat_safe",
    "expires_at",
    "credential_id",
    "credential_scopes",
    "credential_expires_at",
    "reason",
    "occurred_at",
    "signed_by",
    "signature",
    "refused_reason",
)
_GRANT_COLUMNS = (
    "tenant_id",
    "principal",
    "tool_name",
    "revoked",
    "destinations",
    "repeat_safe",
    "expires_at",
    "credential_id",
    "credential_scopes",
    "credential_expires_at",
    "version",
    "updated_at",
    "changed_by",
    "reason",
    "signed_by",
    "signature",
)
_REVOKED_CREDENTIAL_COLUMNS = (
    "tenant_id",
    "credential_id",
    "revoked_at",
    "version",
    "revoked_by",
    "reason",
    "signed_by",
    "signature",
)


def _upsert(table: str, columns: Sequence[str], keys: Sequence[str]) -> str:
    updates = ", ".join(f'"{c}" = EXCLUDED."{c}"' for c in columns if c not in keys)
    placeholders = ", ".join(["%s"] * len(columns))
    return (
        f"INSERT INTO {table} ({_cols(columns)}) VALUES ({placeholders}) "
        f"ON CONFLICT ({_cols(keys)}) DO UPDATE SET {updates}"
    )


_UPSERT_GRANT = _upsert("policy_grants", _GRANT_COLUMNS, ("tenant_id", "principal", "tool_name"))
_UPSERT_REVOKED_CREDENTIAL = _upsert(
    "revoked_credentials", _REVOKED_CREDENTIAL_COLUMNS, ("tenant_id", "credential_id")
)
_INSERT_POLICY_HISTORY = (
    f"INSERT INTO policy_history ({_cols(_POLICY_HISTORY_COLUMNS)}) "
    f"VALUES ({', '.join(['%s'] * len(_POLICY_HISTORY_COLUMNS))})"
)


_SEEN_BEFORE = """SELECT event_id, topic, partition, "offset" FROM policy_history
 WHERE event_id = ANY(%s) AND refused_reason IS NULL"""


def _folded_before(
    cur: psycopg.Cursor[Any], changes: Sequence[SourcedPolicyChange]
) -> dict[str, Coordinates]:
    """Event id -> where it was folded, for ``changes`` whose event id was folded already."""
    cur.execute(_SEEN_BEFORE, ([c.event.event_id for c in changes],))
    return {event_id: Coordinates(t, p, o) for event_id, t, p, o in cur.fetchall()}


def _write_policy(cur: psycopg.Cursor[Any], changes: Sequence[SourcedPolicyChange]) -> list[str]:
    """Fold policy changes (in log order) into the policy tables, in the batch's transaction;
    returns why each change that was not applied was not.

    The state of a subject is its last change's in log order, whatever its timestamp: the same
    rows a replay of the compacted topic (which keeps only that record) gives. A change whose
    event id was folded already, from another offset, is a replay (signed once, a record can be
    written again later: a replayed grant would undo the revocation that followed it); it is
    kept in ``policy_history`` with the reason and not applied. Changes are rare, so plain
    statements do; the operation records' COPY path is not involved.
    """
    history: list[tuple[Any, ...]] = []
    grants: dict[bytes, tuple[Any, ...]] = {}
    credentials: dict[bytes, tuple[Any, ...]] = {}
    stale: list[str] = []
    folded = _folded_before(cur, changes)
    for item in changes:
        c, e = item.coordinates, item.event
        first = folded.setdefault(e.event_id, c)
        refused = None
        if first != c:
            refused = (
                f"{e.event_id} ({e.change.value}, at {c.topic}[{c.partition}]@{c.offset}) was "
                f"folded already from {first.topic}[{first.partition}]@{first.offset}: a "
                "replayed record, not a new change"
            )
            stale.append(refused)
        history.append(
            (
                c.topic,
                c.partition,
                c.offset,
                e.event_id,
                e.tenant_id,
                e.actor_id,
                e.change.value,
                e.principal,
                e.tool_name,
                list(e.destinations),
                e.repeat_safe,
                e.expires_at,
                e.credential_id,
                list(e.credential_scopes),
                e.credential_expires_at,
                e.reason,
                e.occurred_at,
                e.signed_by,
                e.signature,
                refused,
            )
        )
        if refused is not None:
            continue
        if e.change is PolicyChange.REVOKE_CREDENTIAL:
            credentials[e.subject_key()] = (
                e.tenant_id,
                e.credential_id,
                e.occurred_at,
                e.event_id,
                e.actor_id,
                e.reason,
                e.signed_by,
                e.signature,
            )
            continue
        grants[e.subject_key()] = (
            e.tenant_id,
            e.principal,
            e.tool_name,
            e.change is PolicyChange.REVOKE,
            list(e.destinations),
            e.repeat_safe,
            e.expires_at,
            e.credential_id,
            list(e.credential_scopes),
            e.credential_expires_at,
            e.event_id,
            e.occurred_at,
            e.actor_id,
            e.reason,
            e.signed_by,
            e.signature,
        )
    cur.executemany(_INSERT_POLICY_HISTORY, history)
    if grants:
        cur.executemany(_UPSERT_GRANT, list(grants.values()))
    if credentials:
        cur.executemany(_UPSERT_REVOKED_CREDENTIAL, list(credentials.values()))
    return stale

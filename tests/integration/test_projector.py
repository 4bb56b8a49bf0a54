"""The projector against the real broker and database: projections equal the independent fold."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned
from ledger.domain.ids import event_id, operation_id
from ledger.domain.states import ExecutionState
from ledger.kafka import connection_config
from ledger.metrics import Metrics
from ledger.records import Coordinates, ProjectionBatch, SourcedEvent
from ledger.settings import Settings
from opledger.workload import Workload
from processors.batch_reader import BatchProjector
from projections import writer
from projections.writer import PostgresProjection
from tests.support import (
    assert_projection_matches,
    independent_fold,
    produce,
    produce_raw,
    project_in_process,
    workload_events,
)


def test_projections_equal_the_independent_fold(isolated: Settings) -> None:
    events = workload_events(1500, seed=11)
    produce(isolated, events)
    project_in_process(isolated)
    summary = assert_projection_matches(isolated, independent_fold(isolated))
    assert summary["operations"] == 1500
    assert summary["history"] == len(events)
    assert summary["duplicates"] > 0, "the workload repeats appends; they must be recognised"
    assert summary["anomalies"] == 0


def test_redelivered_batch_changes_nothing(isolated: Settings) -> None:
    events = workload_events(300, seed=3)
    items = [
        SourcedEvent(
            Coordinates(
                isolated.execution_topic if e.kind == "execution" else isolated.delivery_topic, 0, i
            ),
            e,
            0,
        )
        for i, e in enumerate(events)
    ]
    next_offsets = {
        (isolated.execution_topic, 0): len(events),
        (isolated.delivery_topic, 0): len(events),
    }
    batch = ProjectionBatch(items, [], next_offsets)
    sink = PostgresProjection.connect(isolated.dsn)
    try:
        first = sink.project("test", batch)
        with psycopg.connect(isolated.dsn) as conn:
            before = conn.execute(
                "SELECT (SELECT count(*) FROM operation_history), "
                "(SELECT sum(version) FROM agent_operations), (SELECT sum(version) FROM deliveries)"
            ).fetchone()
        # Kafka redelivers the whole batch (say the process died before its ack reached us).
        second = sink.project("test", batch)
        with psycopg.connect(isolated.dsn) as conn:
            after = conn.execute(
                "SELECT (SELECT count(*) FROM operation_history), "
                "(SELECT sum(version) FROM agent_operations), (SELECT sum(version) FROM deliveries)"
            ).fetchone()
    finally:
        sink.close()
    assert sum(first.applied.values()) > 0
    assert second.skipped_redelivered == len(events)
    assert sum(second.applied.values()) == 0
    assert before == after
    assert before is not None and before[0] == len(events)


def test_poison_and_illegal_records_do_not_stop_the_projector(isolated: Settings) -> None:
    good = workload_events(50, seed=5)
    produce(isolated, good[: len(good) // 2])
    produce_raw(isolated, isolated.execution_topic, b"op_x", b"not avro at all")
    produce_raw(isolated, isolated.delivery_topic, b"op_y", b"\xc3\x01" + b"\x00" * 8 + b"body")
    first = next(e for e in good if isinstance(e, ExecutionTransitioned))
    fresh_op = operation_id(2, b"\x02" * 10)
    intent = first.model_copy(
        update={"event_id": event_id(2, b"\x03" * 10), "operation_id": fresh_op}
    )
    illegal = intent.model_copy(
        update={
            "event_id": event_id(2, b"\x04" * 10),
            "state": ExecutionState.SUCCEEDED,
            "attempt": 1,
            "result_ref": "sha256:" + "0" * 64,
        }
    )
    # SUCCEEDED straight after INTENT_RECORDED skips the dispatch: illegal, stored as an anomaly.
    produce(isolated, [intent, illegal])
    produce(isolated, good[len(good) // 2 :])
    projector = project_in_process(isolated)
    summary = assert_projection_matches(isolated, independent_fold(isolated))
    assert summary["dead"] == 2
    assert summary["anomalies"] == 1
    counted = {
        (s.labels["machine"], s.labels["kind"]): s.value
        for family in projector._metrics.anomalies.collect()
        for s in family.samples
        if s.name == "opledger_anomalies_total"
    }
    assert counted == {("execution", "illegal"): 1}
    with psycopg.connect(isolated.dsn) as conn:
        reasons = [r[0] for r in conn.execute("SELECT reason FROM anomalies").fetchall()]
    assert reasons == ["illegal execution transition INTENT_RECORDED -> SUCCEEDED"]
    # The dead letters are on the dead-letter topic with the reason and source coordinates.
    consumer = Consumer({**connection_config(isolated), "group.id": "dlq-check"})
    consumer.assign(
        [TopicPartition(isolated.dead_letter_topic, p, 0) for p in range(isolated.partitions)]
    )
    found = []
    for _ in range(20):
        found += [m for m in consumer.consume(100, 0.5) if not m.error()]
        if len(found) >= 2:
            break
    consumer.close()
    assert len(found) == 2
    for m in found:
        headers = dict(m.headers())
        assert headers["opledger-dlq-reason"]
        assert headers["opledger-source-topic"].decode() in (
            isolated.execution_topic,
            isolated.delivery_topic,
        )
        assert int(headers["opledger-source-offset"].decode()) >= 0
    assert default_codec()  # the codec still loads after all that


def test_lag_gauge_tracks_unprojected_records(isolated: Settings) -> None:
    settings = isolated.with_(projector_batch=50)
    events = workload_events(100, seed=9)
    produce(settings, events)
    registry = CollectorRegistry()
    sink = PostgresProjection.connect(settings.dsn)
    projector = BatchProjector(settings, sink, default_codec(), Metrics.create(registry))
    projector._consumer = projector._open()  # drive the loop step by step

    def lag() -> float:
        projector._report_lag(every_s=0)
        total = 0.0
        for topic in (settings.execution_topic, settings.delivery_topic):
            value = registry.get_sample_value("opledger_projector_lag_records", {"topic": topic})
            total += value or 0.0
        return total

    try:
        # Until a batch applied something: the first fetch fills the watermark cache, and a
        # first batch of deliveries alone is held back for its executions (decision 002),
        # applying nothing, which left the lag at every record (one failed run).
        deadline = time.monotonic() + 60
        while True:
            report = projector.run_once()
            if report is not None and sum(report.applied.values()) > 0:
                break
            assert time.monotonic() < deadline, "no batch applied anything"
        assert 0 < lag() < len(events)
        for _ in range(200):
            projector.run_once()
            if lag() == 0:
                break
        assert lag() == 0
    finally:
        projector.close()
        sink.close()


def _interleaved(count: int, seed: int) -> list:
    """The workload's events with operations interleaved, so each operation spans batches."""
    per_operation = [list(op) for op in Workload(seed=seed).operations(count)]
    events = []
    while any(per_operation):
        for op in per_operation:
            if op:
                events.append(op.pop(0))
    return events


def _batches(settings: Settings, events: list, size: int) -> list[ProjectionBatch]:
    """Consecutive batches as one reader of partition 0 of both topics would fetch them."""
    batches = []
    for start in range(0, len(events), size):
        chunk = events[start : start + size]
        items = [
            SourcedEvent(
                Coordinates(
                    settings.execution_topic if e.kind == "execution" else settings.delivery_topic,
                    0,
                    start + i,
                ),
                e,
                0,
            )
            for i, e in enumerate(chunk)
        ]
        end = start + len(chunk)
        batches.append(
            ProjectionBatch(
                items, [], {(settings.execution_topic, 0): end, (settings.delivery_topic, 0): end}
            )
        )
    return batches


def _tables(settings: Settings) -> tuple[list[Any], ...]:
    with psycopg.connect(settings.dsn) as conn:
        return (
            conn.execute("SELECT * FROM agent_operations ORDER BY operation_id").fetchall(),
            conn.execute("SELECT * FROM deliveries ORDER BY operation_id, destination").fetchall(),
            conn.execute(
                "SELECT event_id, outcome FROM operation_history ORDER BY event_id, outcome"
            ).fetchall(),
            conn.execute("SELECT count(*) FROM anomalies").fetchall(),
        )


def test_two_projections_taking_turns_fold_from_the_stored_rows(isolated: Settings) -> None:
    """Each projection keeps the rows it committed in memory; when another one (a zombie and
    its replacement sharing the consumer name) commits in between, the rows it kept are stale
    and must not be folded from: the tables must equal one projection's."""
    batches = _batches(isolated, _interleaved(120, seed=21), size=40)
    assert len(batches) > 6
    first, second = (
        PostgresProjection.connect(isolated.dsn),
        PostgresProjection.connect(isolated.dsn),
    )
    try:
        for i, batch in enumerate(batches):
            (first if (i // 2) % 2 == 0 else second).project("test", batch)
    finally:
        first.close()
        second.close()
    taking_turns = _tables(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        conn.execute(
            "TRUNCATE operation_history, agent_operations, deliveries, anomalies, projector_offsets"
        )
    alone = PostgresProjection.connect(isolated.dsn)
    try:
        for batch in batches:
            alone.project("test", batch)
    finally:
        alone.close()
    assert taking_turns == _tables(isolated)
    assert len(taking_turns[0]) == 120 and taking_turns[1]


def test_rows_stay_cached_when_a_batch_reads_a_partition_for_the_first_time(
    isolated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that reads a partition for the first time stores a 0 offset for it before it
    folds; that is not somebody else's commit, so the rows this projection just committed are
    still used instead of read back. Somebody else's commit still makes it read them back."""
    operations = list(Workload(seed=8).operations(40))
    executions = [e for op in operations for e in op if isinstance(e, ExecutionTransitioned)]
    deliveries = [e for op in operations for e in op if isinstance(e, DeliveryTransitioned)]
    assert deliveries
    ex, dl = isolated.execution_topic, isolated.delivery_topic

    def sourced(topic: str, events: list[Any]) -> list[SourcedEvent]:
        return [SourcedEvent(Coordinates(topic, 0, i), e, 0) for i, e in enumerate(events)]

    parsed = 0
    original = writer.execution_from_row

    def counting(row: Any) -> Any:
        nonlocal parsed
        parsed += 1
        return original(row)

    monkeypatch.setattr(writer, "execution_from_row", counting)
    sink = PostgresProjection.connect(isolated.dsn)
    try:
        sink.project("c", ProjectionBatch(sourced(ex, executions), [], {(ex, 0): len(executions)}))
        parsed = 0
        half = len(deliveries) // 2
        first = ProjectionBatch(sourced(dl, deliveries[:half]), [], {(dl, 0): half})
        assert sum(sink.project("c", first).applied.values()) > 0
        assert parsed == 0, "rows committed by this projection were read back"
        # Somebody else's commit moves an offset: the cached rows may be stale now.
        with psycopg.connect(isolated.dsn) as conn:
            conn.execute(
                "UPDATE projector_offsets SET next_offset = %s WHERE consumer = 'c' AND topic = %s",
                (len(executions) + 1000, ex),
            )
        rest = ProjectionBatch(
            [
                SourcedEvent(Coordinates(dl, 0, half + i), e, 0)
                for i, e in enumerate(deliveries[half:])
            ],
            [],
            {(dl, 0): len(deliveries)},
        )
        sink.project("c", rest)
        assert parsed > 0, "rows were used from the cache after somebody else's commit"
    finally:
        sink.close()

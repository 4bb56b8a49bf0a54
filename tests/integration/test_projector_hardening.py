"""Nothing a topic holds stops the projector, against the real broker and database: values the
database refuses, text the contract forbids written by a raw producer, records too large to
republish, deliveries read before their execution, and a database connection that goes away."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.dead_letters import DLQ_INLINE_LIMIT
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.kafka import connection_config, partition_for
from ledger.metrics import Metrics
from ledger.records import Coordinates, ProjectionBatch, SourcedEvent
from ledger.settings import Settings
from opledger.workload import Workload
from processors.batch_reader import BatchProjector
from projections.writer import PostgresProjection
from tests.support import (
    assert_projection_matches,
    caught_up,
    independent_fold,
    produce,
    project_in_process,
    read_all,
    workload_events,
)


def _dead_letter_records(settings: Settings) -> list[tuple[dict[str, bytes], bytes | None]]:
    consumer = Consumer({**connection_config(settings), "group.id": "dlq-check"})
    ends = {}
    meta = consumer.list_topics(settings.dead_letter_topic, timeout=10)
    for p in meta.topics[settings.dead_letter_topic].partitions:
        ends[p] = consumer.get_watermark_offsets(
            TopicPartition(settings.dead_letter_topic, p), timeout=10
        )[1]
    consumer.assign([TopicPartition(settings.dead_letter_topic, p, 0) for p in ends])
    out: list[tuple[dict[str, bytes], bytes | None]] = []
    deadline = time.monotonic() + 30
    while len(out) < sum(ends.values()) and time.monotonic() < deadline:
        for m in consumer.consume(100, 1.0):
            if m.error() is None:
                out.append((dict(m.headers() or []), m.value()))
    consumer.close()
    return out


def test_records_the_database_refuses_are_isolated_and_everything_else_commits(
    isolated: Settings,
) -> None:
    # A constraint the data cannot meet: every event of the "poison" actor is refused by
    # PostgreSQL itself, mid-batch, among thousands that are fine.
    PostgresProjection.connect(isolated.dsn).close()  # create the tables
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE operation_history ADD CONSTRAINT no_poison CHECK (actor_id <> 'poison')"
        )
    events = workload_events(600, seed=5)
    poison_ops = {e.operation_id for e in events[::97]}
    events = [
        e.model_copy(update={"actor_id": "poison"}) if e.operation_id in poison_ops else e
        for e in events
    ]
    produce(isolated, events)
    project_in_process(isolated)

    refused: set[tuple[str, int, int]] = set()
    codec = default_codec()
    for topic in (isolated.execution_topic, isolated.delivery_topic):
        for partition, offset, _key, value in read_all(isolated, topic):
            if codec.decode(value or b"").actor_id == "poison":
                refused.add((topic, partition, offset))
    assert refused
    summary = assert_projection_matches(isolated, independent_fold(isolated, refused))
    assert summary["dead"] == len(refused)
    assert summary["history"] == len(events) - len(refused)
    with psycopg.connect(isolated.dsn) as conn:
        reasons = {r[0] for r in conn.execute("SELECT reason FROM dead_letters").fetchall()}
    assert all("refused by the projection database" in r and "no_poison" in r for r in reasons)
    dlq = _dead_letter_records(isolated)
    assert len(dlq) == len(refused), "each refused record is dead-lettered once"
    assert {
        (
            h["opledger-source-topic"].decode(),
            int(h["opledger-source-partition"]),
            int(h["opledger-source-offset"]),
        )
        for h, _ in dlq
    } == refused


def test_nul_written_by_a_raw_producer_is_dead_lettered_not_fatal(isolated: Settings) -> None:
    codec = default_codec()
    good = workload_events(50, seed=8)
    first = good[0]
    assert isinstance(first, ExecutionTransitioned)
    # model_construct skips validation, as a foreign producer bypassing the SDK would.
    nul = ExecutionTransitioned.model_construct(
        **{**first.model_dump(), "state": ExecutionState.FAILED, "attempt": 0, "error": "boom\x00"}
    )
    producer = Producer({**connection_config(isolated)})
    producer.produce(
        isolated.execution_topic, key=first.operation_id.encode(), value=codec.encode(nul)
    )
    producer.flush(10)
    produce(isolated, good)
    project_in_process(isolated)
    summary = assert_projection_matches(isolated, independent_fold(isolated))
    assert summary["dead"] == 1
    with psycopg.connect(isolated.dsn) as conn:
        (reason,) = conn.execute("SELECT reason FROM dead_letters").fetchone() or ("",)
    assert "NUL" in reason


def test_a_record_too_large_to_republish_is_dead_lettered_by_reference(
    isolated: Settings,
) -> None:
    huge = b"\x00junk" * 208_000  # 1,040,000 bytes: accepted by the broker, never decodable
    assert len(huge) > DLQ_INLINE_LIMIT
    producer = Producer(
        {
            **connection_config(isolated),
            "message.max.bytes": 1_048_576,
            "compression.type": "none",
        }
    )
    producer.produce(isolated.execution_topic, key=b"op_huge", value=huge)
    assert producer.flush(30) == 0
    produce(isolated, workload_events(20, seed=9))
    project_in_process(isolated)
    summary = assert_projection_matches(isolated, independent_fold(isolated))
    assert summary["operations"] == 20 and summary["dead"] == 1
    with psycopg.connect(isolated.dsn) as conn:
        row = conn.execute("SELECT size_bytes, by_reference FROM dead_letters").fetchone()
    assert row == (len(huge), True)
    ((headers, value),) = _dead_letter_records(isolated)
    assert headers["opledger-dlq-by-reference"] == b"1"
    reference: dict[str, Any] = json.loads(value or b"")
    assert reference["sha256"] == hashlib.sha256(huge).hexdigest()
    assert reference["size_bytes"] == len(huge)
    assert reference["source"]["topic"] == isolated.execution_topic


def _sourced(settings: Settings, events: list[Transition], start: int) -> list[SourcedEvent]:
    out = []
    for index, event in enumerate(events):
        topic = settings.execution_topic if event.kind == "execution" else settings.delivery_topic
        out.append(SourcedEvent(Coordinates(topic, 0, start + index), event, 0))
    return out


def test_a_delivery_read_before_its_execution_waits_for_it(isolated: Settings) -> None:
    """Deliveries and executions are separate topics: after a restart with a backlog, the reader
    can see a delivery first. It is held back (and its partition rewound), not called an
    anomaly, while the execution topic has records the projector has not read."""
    (op,) = [e for e in Workload(seed=4).operations(1)]
    executions = [e for e in op if isinstance(e, ExecutionTransitioned)]
    deliveries = [e for e in op if isinstance(e, DeliveryTransitioned)]
    assert executions[-1].state is ExecutionState.SUCCEEDED and deliveries
    sink = PostgresProjection.connect(isolated.dsn)
    ex, dl = isolated.execution_topic, isolated.delivery_topic
    try:
        early = ProjectionBatch(
            _sourced(isolated, deliveries, 0),
            [],
            {(dl, 0): len(deliveries)},
            execution_topic=ex,
            execution_end=lambda _p: len(executions),  # unread executions exist
        )
        report = sink.project("c", early)
        assert report.rewind == {(dl, 0): 0}
        assert sum(report.anomalies.values()) == sum(report.applied.values()) == 0
        later = ProjectionBatch(
            _sourced(isolated, executions, 0) + _sourced(isolated, deliveries, 0),
            [],
            {(ex, 0): len(executions), (dl, 0): len(deliveries)},
            execution_topic=ex,
            execution_end=lambda _p: len(executions),
        )
        report = sink.project("c", later)
        assert report.rewind == {}
        assert report.anomalies == {"execution": 0, "delivery": 0, "control": 0}
        with psycopg.connect(isolated.dsn) as conn:
            states = conn.execute("SELECT DISTINCT state FROM deliveries").fetchall()
        assert states and all(s != (DeliveryState.PENDING.value,) for s in states)
        # When the execution topic is read to its end and there is still no execution, the
        # delivery is an anomaly (nothing will ever make it legal).
        orphan = next(iter(Workload(seed=6).operations(1)))
        orphan_deliveries = [e for e in orphan if isinstance(e, DeliveryTransitioned)][:1]
        final = ProjectionBatch(
            _sourced(isolated, orphan_deliveries, len(deliveries)),
            [],
            {(dl, 0): len(deliveries) + 1},
            execution_topic=ex,
            execution_end=lambda _p: len(executions),
        )
        report = sink.project("c", final)
        assert report.rewind == {} and report.anomalies["delivery"] == 1
        with psycopg.connect(isolated.dsn) as conn:
            kind = conn.execute("SELECT kind FROM anomalies").fetchone()
        assert kind == ("awaiting_execution",)
    finally:
        sink.close()


def test_the_projector_rides_out_its_database_connection_being_killed(
    isolated: Settings,
) -> None:
    sink = PostgresProjection.connect(isolated.dsn)
    projector = BatchProjector(
        isolated, sink, default_codec(), Metrics.create(CollectorRegistry()), max_backoff_s=0.2
    )
    projector._consumer = projector._open()
    stalls = 0
    try:
        for round_ in range(3):
            produce(isolated, workload_events(100, seed=20 + round_))
            with psycopg.connect(isolated.dsn, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'opledger-projector' "
                    "AND datname = current_database()"
                )
            deadline = time.monotonic() + 60
            while not caught_up(isolated):
                assert time.monotonic() < deadline, "projector did not recover"
                projector.run_once()
                stalls += not projector.health.progressing
        assert projector.health.progressing
    finally:
        projector.close()
        sink.close()
    assert stalls >= 1, "the killed connection was noticed (health went to stalled)"
    assert_projection_matches(isolated, independent_fold(isolated))


def test_a_record_on_the_wrong_partition_is_dead_lettered(isolated: Settings) -> None:
    """A producer with librdkafka's default partitioner (not murmur2) puts a correctly keyed
    record on another partition than its operation's other records: refused, so that a replay
    can never order it differently."""
    intent, dispatched = [e for e in workload_events(1, seed=31)[0:2]]
    key = intent.operation_id.encode()
    home = partition_for(key, isolated.partitions)
    stray = (home + 1) % isolated.partitions
    producer = Producer({**connection_config(isolated)})
    codec = default_codec()
    producer.produce(isolated.execution_topic, key=key, value=codec.encode(intent), partition=home)
    producer.produce(
        isolated.execution_topic, key=key, value=codec.encode(dispatched), partition=stray
    )
    assert producer.flush(10) == 0
    project_in_process(isolated)
    assert_projection_matches(isolated, independent_fold(isolated))
    with psycopg.connect(isolated.dsn) as conn:
        row = conn.execute("SELECT execution_state FROM agent_operations").fetchone()
        (reason,) = conn.execute("SELECT reason FROM dead_letters").fetchone() or ("",)
    assert row == ("INTENT_RECORDED",)
    assert f"on partition {stray}" in reason

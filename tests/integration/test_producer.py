"""The producer SDK against the real broker and PostgreSQL (the ``isolated`` fixture gives each
test its own topics and database)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from uuid import uuid4

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned, Transition
from ledger.domain.ids import content_ref, event_id, request_hash
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import RecordTooLargeError
from ledger.kafka import MESSAGE_MAX_BYTES, connection_config, partition_for
from ledger.log import KafkaTransport, OutgoingRecord, fits, record_size
from ledger.settings import Settings
from producers import (
    MAX_RESULT_BYTES,
    AsyncTransitionRecorder,
    DeliveryError,
    DeliveryTimeoutError,
    IllegalTransitionError,
    OperationState,
    ResultStore,
    ResultStoreError,
    TrackedOperation,
    TransitionRecorder,
)
from producers.operation import advance

TENANT = "tenant-a"
ACTOR = "agent-7"


@dataclass(frozen=True)
class Read:
    partition: int
    offset: int
    key: bytes
    value: bytes
    headers: dict[str, bytes]
    event: Transition


def _consumer(settings: Settings) -> Consumer:
    return Consumer(
        {
            **connection_config(settings),
            "group.id": f"test-{uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )


# librdkafka does not flag these retriable for a watermark query, but right after topic creation
# they only mean "ask again in a moment".
_LEADER_NOT_KNOWN_YET = {
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
}


def _high_watermark(consumer: Consumer, topic: str, partition: int) -> int:
    # A fresh client can ask before it learned the leaders of a just-created topic; the broker
    # then answers NOT_LEADER, which is retriable.
    deadline = time.monotonic() + 10
    while True:
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(topic, partition), 10)[1])
        except KafkaException as exc:
            error = exc.args[0]
            retry = error.retriable() or error.code() in _LEADER_NOT_KNOWN_YET
            if not retry or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def end_offsets(settings: Settings, topic: str) -> list[int]:
    consumer = _consumer(settings)
    try:
        return [_high_watermark(consumer, topic, p) for p in range(settings.partitions)]
    finally:
        consumer.close()


def read_all(settings: Settings, topic: str) -> list[Read]:
    """Every record on ``topic`` up to the current end offsets, by partition then offset."""
    consumer = _consumer(settings)
    try:
        ends = {p: _high_watermark(consumer, topic, p) for p in range(settings.partitions)}
        wanted = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in wanted])
        got: list[Read] = []
        deadline = time.monotonic() + 20
        while wanted and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            value = msg.value()
            got.append(
                Read(
                    msg.partition(),
                    msg.offset(),
                    msg.key(),
                    value,
                    dict(msg.headers() or []),
                    default_codec().decode(value),
                )
            )
            if msg.offset() + 1 >= ends[msg.partition()]:
                wanted.discard(msg.partition())
        assert not wanted, f"partitions {wanted} not read to their end"
        return sorted(got, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()


@pytest.fixture
def recorder(isolated: Settings) -> Iterator[TransitionRecorder]:
    with TransitionRecorder.connect(isolated) as rec:
        yield rec


def test_recorded_history_reads_back_in_order_on_the_keyed_partition(
    isolated: Settings, recorder: TransitionRecorder
) -> None:
    payload = b'{"provider_response": "the whole body, kept out of Kafka 5f1c"}'
    op = recorder.intent(TENANT, ACTOR, "send_email", {"to": "a@example.com", "n": 1})
    recorder.dispatched(op, provider_ref="msg-123")
    recorder.succeeded(op, payload, content_type="application/json")
    recorder.delivery_pending(op, "hook:billing")
    recorder.delivery_sent(op, "hook:billing")
    recorder.delivery_acked(op, "hook:billing")

    executions = read_all(isolated, isolated.execution_topic)
    deliveries = read_all(isolated, isolated.delivery_topic)
    key = op.operation_id.encode()
    # Where librdkafka's partitioner put the records is what readers must be able to compute.
    expected_partition = partition_for(key, isolated.partitions)
    assert {r.partition for r in executions + deliveries} == {expected_partition}

    assert [r.event.state for r in executions] == [
        ExecutionState.INTENT_RECORDED,
        ExecutionState.DISPATCHED,
        ExecutionState.SUCCEEDED,
    ]
    assert [r.event.state for r in deliveries] == [
        DeliveryState.PENDING,
        DeliveryState.SENT,
        DeliveryState.ACKED,
    ]
    for r in executions + deliveries:
        assert r.key == key
        # Co-partitioned: the same partition number in both topics, the one Java would choose.
        assert r.partition == expected_partition
        assert r.headers["opledger-tenant"] == TENANT.encode()
        assert r.headers["opledger-writer"] == b"sdk"
        assert r.event.tenant_id == TENANT and r.event.actor_id == ACTOR
        assert payload not in r.value
    assert {r.headers["opledger-schema"] for r in executions} == {b"ExecutionTransitioned"}
    assert {r.headers["opledger-schema"] for r in deliveries} == {b"DeliveryTransitioned"}
    assert [r.event.attempt for r in executions] == [0, 1, 1]
    assert [r.event.attempt for r in deliveries] == [0, 1, 1]

    # Folding what the topics hold rebuilds exactly the handle's state: the events read back
    # are the events recorded, in order.
    state: OperationState | None = OperationState(op.operation_id)
    for r in executions + deliveries:
        assert state is not None
        state = advance(state, r.event)
    assert state == op.state

    ref = content_ref(payload)
    succeeded = executions[2].event
    assert isinstance(succeeded, ExecutionTransitioned)
    assert succeeded.result_ref == ref and succeeded.provider_ref is None
    assert executions[1].event.provider_ref == "msg-123"  # type: ignore[union-attr]
    assert deliveries[0].event.result_ref == ref
    assert executions[0].event.request_hash == request_hash(  # type: ignore[union-attr]
        "send_email", {"n": 1, "to": "a@example.com"}
    )
    with ResultStore.connect(isolated.dsn) as store:
        assert store.get(TENANT, ref) == payload


def test_illegal_transition_raises_and_writes_nothing(
    isolated: Settings, recorder: TransitionRecorder
) -> None:
    op = recorder.intent(TENANT, ACTOR, "charge_card", {"amount": 5})
    before = end_offsets(isolated, isolated.execution_topic)
    with pytest.raises(IllegalTransitionError, match="INTENT_RECORDED -> SUCCEEDED"):
        recorder.succeeded(op, b"never stored")
    with pytest.raises(IllegalTransitionError):
        recorder.delivery_acked(op, "hook:x")  # no PENDING/SENT first
    assert end_offsets(isolated, isolated.execution_topic) == before
    assert sum(end_offsets(isolated, isolated.delivery_topic)) == 0
    assert op.execution is not None and op.execution.state is ExecutionState.INTENT_RECORDED
    # The refused SUCCEEDED did not store its result either.
    with ResultStore.connect(isolated.dsn) as store:
        assert store.get(TENANT, content_ref(b"never stored")) is None


def test_repeated_call_is_not_recorded_twice(
    isolated: Settings, recorder: TransitionRecorder
) -> None:
    op = recorder.intent(TENANT, ACTOR, "lookup", {})
    assert recorder.dispatched(op, provider_ref="p-1") is True
    assert recorder.dispatched(op, provider_ref="p-1") is False
    assert recorder.succeeded(op, b"r") is True
    assert recorder.succeeded(op, b"r") is False
    with pytest.raises(IllegalTransitionError, match="already SUCCEEDED"):
        recorder.succeeded(op, b"a different result")
    assert recorder.delivery_pending(op, "hook:a") is True
    assert recorder.delivery_pending(op, "hook:a") is False
    assert recorder.delivery_sent(op, "hook:a") is True
    assert recorder.delivery_sent(op, "hook:a") is False
    assert sum(end_offsets(isolated, isolated.execution_topic)) == 3
    assert sum(end_offsets(isolated, isolated.delivery_topic)) == 2


def test_call_returns_only_after_the_broker_acknowledged(
    isolated: Settings, recorder: TransitionRecorder
) -> None:
    op = recorder.intent(TENANT, ACTOR, "lookup", {"q": 1})
    recorder.dispatched(op)
    # No flush, no close: a fresh consumer sees the record because dispatched() waited for it.
    states = [r.event.state for r in read_all(isolated, isolated.execution_topic)]
    assert states == [ExecutionState.INTENT_RECORDED, ExecutionState.DISPATCHED]


def test_missing_topic_fails_clearly_within_the_timeout(isolated: Settings) -> None:
    missing = isolated.with_(topic_prefix=f"{isolated.topic_prefix}-never-created")
    started = time.monotonic()
    with (
        TransitionRecorder.connect(missing, with_results=False, delivery_timeout_s=3) as rec,
        pytest.raises(DeliveryError, match="never-created") as caught,
    ):
        rec.intent(TENANT, ACTOR, "lookup", {})
    elapsed = time.monotonic() - started
    assert elapsed < 3 + 5 + 2, f"took {elapsed:.1f}s"
    assert caught.value.kafka_error is not None


def test_a_record_over_the_producer_limit_is_refused_and_nothing_is_sent(
    isolated: Settings,
) -> None:
    topic = isolated.execution_topic
    small = OutgoingRecord(topic, b"op_small", b"fits", [("h", b"v")])
    limit_value = b"x" * (MESSAGE_MAX_BYTES - record_size(OutgoingRecord(topic, b"k", b"", [])))
    at_limit = OutgoingRecord(topic, b"k", limit_value, [])
    over = OutgoingRecord(topic, b"k", limit_value + b"x", [])
    assert fits(at_limit) and not fits(over)
    transport = KafkaTransport(isolated)
    try:
        with pytest.raises(RecordTooLargeError, match="nothing was sent"):
            transport.send([small, over])
        assert sum(end_offsets(isolated, topic)) == 0  # not even the small one before it
        transport.send([small])
        assert sum(end_offsets(isolated, topic)) == 1
    finally:
        transport.close()


def test_error_text_is_redacted_before_it_is_recorded(
    isolated: Settings, recorder: TransitionRecorder
) -> None:
    op = recorder.intent(TENANT, ACTOR, "db_query", {"sql": "select 1"})
    recorder.dispatched(op)
    recorder.unknown(op, "connection lost: postgresql://app:hunter2@db/x password=hunter2")
    recorder.failed(op, ConnectionError("login refused for password=hunter2"))
    records = read_all(isolated, isolated.execution_topic)
    assert [r.event.state for r in records][-2:] == [ExecutionState.UNKNOWN, ExecutionState.FAILED]
    for r in records:
        assert b"hunter2" not in r.value
    assert "[REDACTED]" in (records[-1].event.error or "")
    assert (records[-1].event.error or "").startswith("ConnectionError: login refused")


def test_delivery_retry_and_dead_letter(isolated: Settings, recorder: TransitionRecorder) -> None:
    op = recorder.intent(TENANT, ACTOR, "lookup", {})
    recorder.dispatched(op)
    recorder.succeeded(op, b"ok")
    recorder.delivery_pending(op, "hook:a")
    recorder.delivery_sent(op, "hook:a")
    later = datetime.now(UTC) + timedelta(seconds=30)
    assert recorder.delivery_retry(op, "hook:a", later, "HTTP 503 token=abc123456789") is True
    recorder.delivery_sent(op, "hook:a")
    recorder.delivery_dead_lettered(op, "hook:a", "gave up after 2 sends")
    events = [r.event for r in read_all(isolated, isolated.delivery_topic)]
    assert [(e.state, e.attempt) for e in events] == [
        (DeliveryState.PENDING, 0),
        (DeliveryState.SENT, 1),
        (DeliveryState.PENDING, 1),
        (DeliveryState.SENT, 2),
        (DeliveryState.DEAD_LETTERED, 2),
    ]
    assert "abc123456789" not in (events[2].error or "")
    assert op.deliveries["hook:a"].state is DeliveryState.DEAD_LETTERED


def test_append_batch_is_folded_and_all_or_nothing(
    isolated: Settings, recorder: TransitionRecorder
) -> None:
    ops = [recorder.intent(TENANT, ACTOR, "lookup", {"i": i}) for i in range(3)]
    now = datetime.now(UTC)

    def dispatched(op: TrackedOperation, attempt: int) -> ExecutionTransitioned:
        assert op.execution is not None
        return ExecutionTransitioned(
            event_id=event_id(1, os.urandom(10)),
            operation_id=op.operation_id,
            tenant_id=TENANT,
            actor_id=ACTOR,
            occurred_at=now,
            attempt=attempt,
            state=ExecutionState.DISPATCHED,
            tool_name="lookup",
            request_hash=op.execution.request_hash,
        )

    before = sum(end_offsets(isolated, isolated.execution_topic))
    bad = [dispatched(ops[0], 1), dispatched(ops[1], 2)]
    with pytest.raises(IllegalTransitionError, match="event 1"):
        recorder.append(bad, known=ops)
    assert sum(end_offsets(isolated, isolated.execution_topic)) == before

    good = [dispatched(op, 1) for op in ops]
    touched = recorder.append(good + good[:1], known=ops)  # the repeat is dropped
    assert sum(end_offsets(isolated, isolated.execution_topic)) == before + 3
    assert all(touched[op.operation_id] is op for op in ops)
    assert all(op.execution and op.execution.state is ExecutionState.DISPATCHED for op in ops)


def test_result_store_is_tenant_scoped_and_validated(isolated: Settings) -> None:
    with ResultStore.connect(isolated.dsn) as store:
        store.migrate()
        payload = b"tenant A's result"
        ref = store.put("tenant-a", payload, "application/json; charset=utf-8")
        assert ref == content_ref(payload)
        assert store.put("tenant-a", payload, "application/json") == ref  # idempotent
        assert store.get("tenant-a", ref) == payload
        assert store.get("tenant-b", ref) is None
        # The same bytes stored by B are B's own row, readable by B.
        assert store.put("tenant-b", payload) == ref
        assert store.get("tenant-b", ref) == payload
        with pytest.raises(ResultStoreError, match="content type"):
            store.put("tenant-a", b"x", "not a content type")
        with pytest.raises(ResultStoreError, match="limit"):
            store.put("tenant-a", bytes(MAX_RESULT_BYTES + 1))
        with pytest.raises(ResultStoreError, match="not a tenant id"):
            store.put("", b"x")


def test_result_store_replaces_connections_the_server_dropped(isolated: Settings) -> None:
    """The server ends every session of the store (what a PostgreSQL restart does to clients):
    the next put reconnects instead of failing, and so does every one after it."""
    with ResultStore.connect(isolated.dsn) as store:
        store.migrate()
        store.put("tenant-a", b"before")
        for round_ in range(3):
            with psycopg.connect(isolated.dsn, autocommit=True) as admin:
                ended = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'opledger-sdk' AND datname = current_database()"
                ).fetchone()
            assert ended is not None and ended[0] >= 1
            payload = f"after {round_}".encode()
            assert store.get("tenant-a", store.put("tenant-a", payload)) == payload


def test_result_store_serves_threads_concurrently(isolated: Settings) -> None:
    with ResultStore.connect(isolated.dsn) as store:
        store.migrate()
        with ThreadPoolExecutor(16) as pool:
            refs = list(
                pool.map(lambda i: store.put("tenant-a", f"payload {i}".encode()), range(400))
            )
        assert len(set(refs)) == 400
        assert all(store.get("tenant-a", ref) is not None for ref in refs)


def test_one_commit_stores_a_group_with_the_same_payload_twice(isolated: Settings) -> None:
    """Two callers storing the same bytes at once can land in one shared commit: the statement
    holds the row twice, and stores it once."""
    with ResultStore.connect(isolated.dsn) as store:
        store.migrate()
        same = ResultStore.prepare("tenant-a", b"same bytes")
        other = ResultStore.prepare("tenant-a", b"other bytes")
        store.put_many([same, other, same])
        assert store.get("tenant-a", same.result_ref) == b"same bytes"
        assert store.get("tenant-a", other.result_ref) == b"other bytes"
        with psycopg.connect(isolated.dsn) as conn:
            rows = conn.execute("SELECT count(*) FROM results").fetchone()
        assert rows == (2,)


def test_one_recorder_serves_sixteen_threads(isolated: Settings) -> None:
    """Sixteen threads share one recorder (one producer, one pool): every call completes and
    each operation's history is in order on its partition."""
    calls_per_thread = 25

    def work(thread: int) -> list[str]:
        ops = []
        for n in range(calls_per_thread):
            op = shared.intent(TENANT, f"agent-{thread}", "send_email", {"t": thread, "n": n})
            shared.dispatched(op, provider_ref=op.operation_id)
            shared.succeeded(op, f"result {thread}/{n}".encode(), content_type="text/plain")
            ops.append(op.operation_id)
        return ops

    with TransitionRecorder.connect(isolated) as shared, ThreadPoolExecutor(16) as pool:
        ops = [op for batch in pool.map(work, range(16)) for op in batch]
    assert len(set(ops)) == 16 * calls_per_thread
    by_op: dict[str, list[ExecutionState]] = {}
    for r in read_all(isolated, isolated.execution_topic):
        by_op.setdefault(r.event.operation_id, []).append(r.event.state)  # type: ignore[arg-type]
    assert set(by_op) == set(ops)
    assert all(
        states
        == [ExecutionState.INTENT_RECORDED, ExecutionState.DISPATCHED, ExecutionState.SUCCEEDED]
        for states in by_op.values()
    )


def test_the_asyncio_recorder_serves_sixteen_tasks(isolated: Settings) -> None:
    async def scenario() -> list[str]:
        async with AsyncTransitionRecorder.connect(isolated) as recorder:

            async def call(n: int) -> str:
                op = await recorder.intent(TENANT, ACTOR, "send_email", {"n": n})
                await recorder.dispatched(op, provider_ref=op.operation_id)
                await recorder.succeeded(op, f"result {n}".encode())
                return op.operation_id

            return list(await asyncio.gather(*(call(n) for n in range(16 * 10))))

    ops = asyncio.run(scenario())
    records = read_all(isolated, isolated.execution_topic)
    assert len(set(ops)) == 160 and len(records) == 3 * 160
    with ResultStore.connect(isolated.dsn) as store:
        succeeded = [r.event for r in records if r.event.state is ExecutionState.SUCCEEDED]
        assert all(store.get(TENANT, e.result_ref or "") is not None for e in succeeded)


def test_a_dead_broker_is_named_and_its_client_log_goes_to_python_logging(
    isolated: Settings, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    dead = isolated.with_(kafka_bootstrap=f"127.0.0.1:{port}")
    caplog.set_level(logging.INFO, logger="opledger.kafka")
    started = time.monotonic()
    with (
        TransitionRecorder.connect(dead, with_results=False, delivery_timeout_s=3) as rec,
        pytest.raises(DeliveryTimeoutError) as caught,
    ):
        rec.intent(TENANT, ACTOR, "lookup", {})
    assert time.monotonic() - started < 3 + 5 + 2
    message = str(caught.value)
    assert f"broker at 127.0.0.1:{port} is unreachable" in message
    assert "topic" not in message and "resend" in message
    assert caught.value.handle.in_doubt is not None
    stderr = capfd.readouterr().err
    assert "Connect to" not in stderr and "FAIL" not in stderr, stderr[-2000:]
    kafka_lines = [r for r in caplog.records if r.name == "opledger.kafka"]
    assert kafka_lines, "librdkafka's complaints reach Python logging"
    # One connection failure repeats every reconnect backoff; the repeats are held back.
    assert len(kafka_lines) <= 5, [r.getMessage() for r in kafka_lines]

"""``ledger.log``: the records every writer sends, the one resend policy, and reads that ride out
a moving cluster (the CI failure of 524ef99: ``offsets_for_times`` raised
NOT_LEADER_FOR_PARTITION for the call as a whole and the SDK's ``execute()`` failed with it)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from ledger.codec import default_codec
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import DeliveryError, DeliveryTimeoutError, RecordTooLargeError
from ledger.log import (
    SCHEMA_HEADER,
    TENANT_HEADER,
    WRITER_HEADER,
    LogTopics,
    LogUnavailableError,
    LogWriter,
    OutgoingRecord,
    RecordBuilder,
    latest_offsets,
    ride_out,
    settling,
)
from tests.support import policy_change
from tests.unit.factories import OP, TENANT, decided, delivery, execution, owned

TOPICS = LogTopics("x.execution", "x.delivery", "x.policy")


def _records(writer: str = "sdk") -> RecordBuilder:
    return RecordBuilder(TOPICS, default_codec(), writer)


@pytest.mark.parametrize(
    ("event", "topic", "schema"),
    [
        (execution(ExecutionState.DISPATCHED, 1), "x.execution", b"ExecutionTransitioned"),
        (delivery(DeliveryState.PENDING, 0), "x.delivery", b"DeliveryTransitioned"),
        (owned(3), "x.execution", b"OwnershipTaken"),
        (decided(1), "x.execution", b"ReconciliationDecided"),
    ],
)
def test_an_operation_event_is_keyed_by_its_operation(
    event: Any, topic: str, schema: bytes
) -> None:
    record = _records("recovery").record(event)
    assert (record.topic, record.key) == (topic, OP.encode())
    assert dict(record.headers) == {
        SCHEMA_HEADER: schema,
        TENANT_HEADER: TENANT.encode(),
        WRITER_HEADER: b"recovery",
    }
    assert default_codec().decode(record.value) == event


def test_a_policy_change_is_keyed_by_its_subject() -> None:
    change = policy_change(tenant_id="acme")
    record = _records("policy").record(change)
    assert (record.topic, record.key) == ("x.policy", change.subject_key())
    assert dict(record.headers)[TENANT_HEADER] == b"acme"
    assert dict(record.headers)[SCHEMA_HEADER] == b"PolicyChanged"


def test_an_unknown_writer_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown writer kind"):
        _records("someone")


class _Transport:
    """Fails the first sends with the given errors, then acknowledges."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.sent: list[list[OutgoingRecord]] = []

    def send(self, records: Sequence[OutgoingRecord]) -> list[tuple[str, int, int]]:
        self.sent.append(list(records))
        if self.errors:
            raise self.errors.pop(0)
        return [(r.topic, 0, i) for i, r in enumerate(records)]

    def close(self) -> None:
        pass


def test_a_lost_acknowledgement_is_sent_again_with_the_same_records() -> None:
    transport = _Transport(DeliveryTimeoutError("no ack"), DeliveryError("refused"))
    writer = LogWriter(transport, TOPICS, "delivery", resends=(0.0, 0.0))
    positions = writer.append([delivery(DeliveryState.SENT, 1)])
    assert positions == [("x.delivery", 0, 0)]
    assert len(transport.sent) == 3
    assert transport.sent[0] == transport.sent[1] == transport.sent[2]


def test_the_resends_end_and_the_last_failure_is_raised() -> None:
    transport = _Transport(*[DeliveryTimeoutError(f"no ack {i}") for i in range(3)])
    writer = LogWriter(transport, TOPICS, "delivery", resends=(0.0, 0.0))
    with pytest.raises(DeliveryTimeoutError, match="no ack 2"):
        writer.append([delivery(DeliveryState.SENT, 1)])


def test_a_record_too_large_is_not_sent_again() -> None:
    transport = _Transport(RecordTooLargeError("too large"))
    writer = LogWriter(transport, TOPICS, "delivery", resends=(0.0, 0.0))
    with pytest.raises(RecordTooLargeError):
        writer.append([delivery(DeliveryState.SENT, 1)])
    assert len(transport.sent) == 1


def _error(code: int) -> KafkaException:
    return KafkaException(KafkaError(code))


class _Answer:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self.topic, self.partition, self.offset, self.error = topic, partition, offset, None


class _Consumer:
    """``offsets_for_times`` raises the given errors for the call as a whole, then answers."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.asked = 0
        self.refreshed: list[str] = []

    def list_topics(self, topic: str, timeout: float) -> None:
        self.refreshed.append(topic)

    def offsets_for_times(self, partitions: list[TopicPartition], timeout: float) -> list[Any]:
        self.asked += 1
        if self.errors:
            raise _error(self.errors.pop(0))
        return [_Answer(tp.topic, tp.partition, 40 + tp.partition) for tp in partitions]


KEYS = [("x.execution", 0), ("x.delivery", 3)]


def test_a_leader_moving_under_a_read_of_the_ends_is_ridden_out() -> None:
    consumer = _Consumer(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError._TRANSPORT)
    ends = latest_offsets(consumer, KEYS, time.monotonic() + 10)  # type: ignore[arg-type]
    assert ends == {("x.execution", 0): 40, ("x.delivery", 3): 43}
    assert consumer.asked == 3
    # Before each new try the cluster is asked again who leads the partitions: a failed
    # offsets request does not refresh the client's view (a SIGKILLed leader stayed "unknown").
    assert consumer.refreshed == ["x.execution", "x.delivery"] * 2


def test_a_read_that_never_settles_names_the_broker_partitions_and_what_to_do() -> None:
    consumer = _Consumer(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 1000)
    started = time.monotonic()
    with pytest.raises(LogUnavailableError) as raised:
        latest_offsets(consumer, KEYS, started + 0.5, bootstrap="b1:9092")  # type: ignore[arg-type]
    assert 0.5 <= time.monotonic() - started < 2
    message = str(raised.value)
    for part in ("b1:9092", "x.execution[0]", "x.delivery[3]", "NOT_LEADER", "ask again"):
        assert part in message


def test_an_error_that_will_not_settle_is_raised_at_once() -> None:
    consumer = _Consumer(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException) as raised:
        latest_offsets(consumer, KEYS, time.monotonic() + 10)  # type: ignore[arg-type]
    assert not isinstance(raised.value, LogUnavailableError)
    assert consumer.asked == 1


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
    ],
)
def test_the_errors_of_a_moving_cluster_settle(code: int) -> None:
    assert settling(_error(code))
    assert settling(KafkaError(code))


def test_other_errors_do_not() -> None:
    assert not settling(_error(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    assert not settling(ValueError("no"))


def test_ride_out_returns_the_first_answer() -> None:
    calls = iter([_error(KafkaError.LEADER_NOT_AVAILABLE), "ok"])

    def call() -> str:
        answer = next(calls)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert ride_out(call, deadline=time.monotonic() + 5, what="x", bootstrap="b") == "ok"

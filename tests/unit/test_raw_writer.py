"""ledger.log's writer of records that are not events, and the one dead-letter send built on it,
against a stand-in producer (their bookkeeping only; the real broker's answers are tested in
tests/integration/test_projector_hardening.py and test_consumer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from ledger.dead_letters import (
    BY_REFERENCE_HEADER,
    REASON_HEADER,
    DeadLetterUnavailableError,
    send_dead_letters,
)
from ledger.log import RawRecord, RawWriter
from ledger.records import Coordinates, DeadLetter
from ledger.settings import Settings

SETTINGS = Settings(home=Path("/nonexistent"), kafka_security="plaintext")


class _Message:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._at = (topic, partition, offset)

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]


class Broker:
    """A producer that answers on flush(): records over ``limit`` bytes are refused by the
    broker as too large, ``full_for`` produce calls meet a full local queue first, and
    ``refuse_locally`` values are refused by the client itself."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.limit = 10_000
        self.full_for = 0
        self.refuse_locally: set[bytes] = set()
        self.silent = False
        self.produced: list[dict[str, Any]] = []
        self.polls = 0
        self._queued: list[tuple[Any, dict[str, Any]]] = []

    def produce(self, topic: str, value: bytes | None, key: bytes | None, **kw: Any) -> None:
        if self.full_for:
            self.full_for -= 1
            raise BufferError("Local: Queue full")
        if value in self.refuse_locally:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        record = {"topic": topic, "value": value, "key": key, **kw}
        self.produced.append(record)
        self._queued.append((kw.pop("on_delivery"), record))

    def poll(self, timeout: float) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float) -> int:
        if self.silent:
            return len(self._queued)
        queued, self._queued = self._queued, []
        for offset, (callback, record) in enumerate(queued):
            if len(record["value"] or b"") > self.limit:
                callback(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), None)
            else:
                callback(None, _Message(record["topic"], record.get("partition", 0), offset))
        return 0


@pytest.fixture
def writer() -> tuple[RawWriter, Broker]:
    made: list[Broker] = []

    def factory(config: dict[str, Any]) -> Broker:
        made.append(Broker(config))
        return made[-1]

    raw = RawWriter(SETTINGS, client_id="test-raw", producer_factory=factory)
    return raw, made[0]


def _letter(offset: int, value: bytes) -> DeadLetter:
    return DeadLetter(Coordinates("source", 0, offset), "bad record", b"k", value, 1_000)


def test_a_send_reports_each_record_by_its_fate(writer: tuple[RawWriter, Broker]) -> None:
    raw, broker = writer
    broker.refuse_locally = {b"refused"}
    records = [
        RawRecord("t", b"k", b"fine", [("h", b"1")]),
        RawRecord("t", b"k", b"x" * 20_000, []),
        RawRecord("t", b"k", b"refused", []),
        RawRecord("t", None, None, [], partition=2),
    ]
    sent = raw.send(records, 1.0)
    assert sent.too_large == [1, 2]
    assert sent.failed == [] and sent.unacknowledged == 0 and not sent.complete
    assert sorted(sent.positions) == [("t", 0, 0), ("t", 2, 2)]
    assert broker.produced[0]["headers"] == [("h", b"1")] and "partition" not in broker.produced[0]
    assert broker.produced[2]["partition"] == 2


def test_a_full_local_queue_is_waited_out_while_acknowledgements_are_served(
    writer: tuple[RawWriter, Broker],
) -> None:
    raw, broker = writer
    broker.full_for = 3
    assert raw.send([RawRecord("t", b"k", b"v", [])], 1.0).complete
    assert broker.polls == 3


def test_a_queue_that_stays_full_is_not_handed_over(writer: tuple[RawWriter, Broker]) -> None:
    raw, broker = writer
    broker.full_for = 10**9
    assert not raw.submit(RawRecord("t", b"k", b"v", []), lambda _e, _m: None, wait_s=0.05)
    sent = raw.send([RawRecord("t", b"k", b"v", [])] * 2, 0.05)
    assert sent.unacknowledged == 2 and not broker.produced


def test_unanswered_records_are_unacknowledged(writer: tuple[RawWriter, Broker]) -> None:
    raw, broker = writer
    broker.silent = True
    sent = raw.send([RawRecord("t", b"k", b"v", [])] * 3, 0.05)
    assert sent.unacknowledged == 3 and not sent.complete


def test_a_dead_letter_the_broker_refuses_as_too_large_goes_as_a_reference(
    writer: tuple[RawWriter, Broker],
) -> None:
    raw, broker = writer
    letters = [_letter(1, b"small"), _letter(2, b"y" * 20_000)]
    extra = [[("opledger-dlq-kind", b"invalid")], [("opledger-dlq-kind", b"conflict")]]
    published = send_dead_letters(raw, "dlq", letters, extra=extra, timeout_s=1.0)
    assert [p.by_reference for p in published] == [False, True]
    assert published[1].coordinates == letters[1].coordinates
    refs = [r for r in broker.produced if (BY_REFERENCE_HEADER, b"1") in r["headers"]]
    assert len(refs) == 1 and b"sha256" in refs[0]["value"]
    # the writer's own headers travel with the letter, and with its reference
    assert ("opledger-dlq-kind", b"conflict") in refs[0]["headers"]
    assert all(any(k == REASON_HEADER for k, _ in r["headers"]) for r in broker.produced)


def test_dead_letters_not_all_acknowledged_raise(writer: tuple[RawWriter, Broker]) -> None:
    raw, broker = writer
    broker.silent = True
    with pytest.raises(DeadLetterUnavailableError, match="1 unacknowledged"):
        send_dead_letters(raw, "dlq", [_letter(1, b"v")], timeout_s=0.05)


def test_a_reference_refused_too_raises(writer: tuple[RawWriter, Broker]) -> None:
    raw, broker = writer
    broker.limit = 10  # even the reference is over it
    with pytest.raises(DeadLetterUnavailableError, match="too large even as a reference"):
        send_dead_letters(raw, "dlq", [_letter(1, b"z" * 100)], timeout_s=1.0)

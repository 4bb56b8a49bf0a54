"""``ledger.topics.watermarks``: a query that meets leadership still settling (a topic created a
moment ago: NOT_LEADER_FOR_PARTITION, seen on 3 tests of one CI run) is asked again until the
deadline; any other error is raised at once."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from ledger.log import watermarks


class _Broker:
    """Answers a watermark query with the given errors first, then (0, 7)."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.asked = 0
        self.refreshed = 0

    def list_topics(self, topic: str, timeout: float) -> None:
        self.refreshed += 1

    def get_watermark_offsets(
        self, _tp: TopicPartition, timeout: float, cached: bool
    ) -> tuple[int, int]:
        assert not cached, "asked of the broker, not of a cache"
        self.asked += 1
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))
        return 0, 7


TP = TopicPartition("t", 0)


def test_leadership_settling_is_asked_again() -> None:
    broker = _Broker(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)
    assert watermarks(broker, TP, time.monotonic() + 10) == (0, 7)  # type: ignore[arg-type]
    assert broker.asked == 3


def test_another_error_is_raised_at_once() -> None:
    broker = _Broker(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        watermarks(broker, TP, time.monotonic() + 10)  # type: ignore[arg-type]
    assert broker.asked == 1


def test_settling_past_the_deadline_is_raised() -> None:
    broker = _Broker(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 100)
    started = time.monotonic()
    with pytest.raises(KafkaException):
        watermarks(broker, TP, started + 0.5)  # type: ignore[arg-type]
    assert 0.5 <= time.monotonic() - started < 2

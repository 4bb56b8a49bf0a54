"""The Kafka transport's own logic with a stand-in client: replacing a producer that hit a fatal
error, and waiting only for one's own acknowledgements. (Against the real broker: the integration
and chaos tiers.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from confluent_kafka import KafkaError

from ledger.errors import DeliveryError
from ledger.log import KafkaTransport, OutgoingRecord
from ledger.settings import Settings

RECORD = OutgoingRecord("t", b"k", b"v", [])


class StandInProducer:
    """Acknowledges what it is given on the next poll(); ``fail`` makes every report an error."""

    made: ClassVar[list[StandInProducer]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.queued: list[Callable[[KafkaError | None, Any], None]] = []
        self.fail: KafkaError | None = None
        self.lock = threading.Lock()
        StandInProducer.made.append(self)

    def produce(self, topic: str, value: bytes, key: bytes, **kw: Any) -> None:
        with self.lock:
            self.queued.append(kw["on_delivery"])

    def poll(self, timeout: float) -> int:
        with self.lock:
            queued, self.queued = self.queued, []
        msg = type(
            "Msg",
            (),
            {"topic": lambda self: "t", "partition": lambda self: 0, "offset": lambda self: 0},
        )()
        for callback in queued:
            callback(self.fail, msg)
        if not queued:
            threading.Event().wait(min(timeout, 0.01))
        return len(queued)

    def purge(self) -> None:
        with self.lock:
            self.queued.clear()

    def flush(self, timeout: float) -> int:
        return 0


@pytest.fixture
def transport() -> Any:
    StandInProducer.made.clear()
    t = KafkaTransport(
        Settings(home=Path("/nonexistent"), kafka_security="plaintext"),
        producer_factory=StandInProducer,
    )
    yield t
    t.close()


def test_a_fatal_error_replaces_the_producer_instead_of_failing_forever(transport: Any) -> None:
    transport.send([RECORD])
    assert len(StandInProducer.made) == 1
    transport._on_client_error(KafkaError(KafkaError._FATAL, "sequence broken", fatal=True))
    transport.send([RECORD])  # works: a fresh client was made for it
    assert len(StandInProducer.made) == 2
    transport.send([RECORD])
    assert len(StandInProducer.made) == 2, "replaced once, not on every send"


def test_a_report_error_fails_only_the_call_it_belongs_to(transport: Any) -> None:
    transport.send([RECORD, RECORD])
    StandInProducer.made[0].fail = KafkaError(KafkaError.INVALID_RECORD, "bad")
    with pytest.raises(DeliveryError, match="INVALID_RECORD"):
        transport.send([RECORD])

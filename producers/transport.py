"""The Kafka edge of the SDK, behind a two-method interface.

:class:`Transport` is all the recorder needs: send these records and return once every one is
acknowledged, or raise. Unit tests of the handle logic give the recorder an in-memory transport;
:class:`KafkaTransport` is the real one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import KafkaError, Producer

from ledger.settings import Settings
from producers.errors import DeliveryError, DeliveryTimeoutError

log = logging.getLogger(__name__)

#: Default for how long the broker gets to acknowledge a record (librdkafka
#: ``delivery.timeout.ms``) before the call fails; a worker waits at most about this long.
DEFAULT_DELIVERY_TIMEOUT_S = 10.0

# librdkafka reports a timed-out message on its own timer scan (about once a second), so the
# SDK waits a little past the configured timeout before it gives up on the report itself.
_REPORT_GRACE_S = 5.0

Headers = list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """One record to append: topic, key (operation_id bytes), encoded value, headers."""

    topic: str
    key: bytes
    value: bytes
    headers: Headers


class Transport(Protocol):
    """Appends records durably; the recorder depends on nothing else of Kafka."""

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        """Return once the broker acknowledged every record; raise DeliveryError otherwise."""
        ...

    def close(self) -> None:
        """Deliver what is queued and release the client."""
        ...


def producer_config(
    settings: Settings,
    *,
    delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
    compression: str = "lz4",
) -> dict[str, Any]:
    """The producer configuration every opledger writer uses (the benchmark's baseline too)."""
    return {
        "bootstrap.servers": settings.bootstrap_servers,
        # Idempotence + acks=all: a broker-side retry cannot duplicate or reorder a record, and
        # "acknowledged" means written to every in-sync replica.
        "enable.idempotence": True,
        "acks": "all",
        "max.in.flight.requests.per.connection": 5,
        # A worker waits for each ack; 5 ms of batching costs little latency and lets
        # concurrent workers and record_many share requests.
        "linger.ms": 5,
        "compression.type": compression,
        # Upper bound on a call: without it a missing topic or a dead broker would make a
        # worker hang for librdkafka's default of 300 s.
        "delivery.timeout.ms": int(delivery_timeout_s * 1000),
        # Java's default partitioner (murmur2): Kafka Streams or Java consumers computing
        # key -> partition agree with us, and execution and delivery topics (same partition
        # count) put one operation's records on the same partition number.
        "partitioner": "murmur2_random",
    }


class _Acks:
    """Delivery reports of one send() call. list.append is atomic under the GIL, so reports
    served by another thread's poll() need no lock."""

    __slots__ = ("errors", "reports")

    def __init__(self) -> None:
        self.reports: list[None] = []
        self.errors: list[tuple[KafkaError, str]] = []

    def on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.errors.append((err, msg.topic()))
        self.reports.append(None)


class KafkaTransport:
    """A confluent-kafka producer that waits for the acknowledgement of what it sends."""

    def __init__(
        self,
        settings: Settings,
        *,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        compression: str = "lz4",
        extra_config: dict[str, Any] | None = None,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
    ) -> None:
        config = producer_config(
            settings, delivery_timeout_s=delivery_timeout_s, compression=compression
        )
        config.update(extra_config or {})
        config["error_cb"] = self._on_client_error
        self._producer = producer_factory(config)
        self._wait_s = delivery_timeout_s + _REPORT_GRACE_S
        self._fatal: KafkaError | None = None

    def _on_client_error(self, err: KafkaError) -> None:
        # Connection hiccups are retried by librdkafka and surface per message if they last;
        # a fatal error (idempotence broken) means this producer may send nothing more.
        if err.fatal():
            self._fatal = err
            log.error("kafka producer fatal error: %s", err)
        else:
            log.warning("kafka producer error: %s", err)

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        """Produce every record, then serve delivery reports until all are in (one wait)."""
        if self._fatal is not None:
            raise DeliveryError(f"producer is unusable: {self._fatal}", self._fatal)
        acks = _Acks()
        callback = acks.on_delivery
        produce = self._producer.produce
        poll = self._producer.poll
        deadline = time.monotonic() + self._wait_s
        for record in records:
            while True:
                try:
                    produce(
                        record.topic,
                        record.value,
                        record.key,
                        headers=record.headers,
                        on_delivery=callback,
                    )
                    break
                except BufferError:
                    # librdkafka's local queue is full: serving reports makes room.
                    if time.monotonic() > deadline:
                        raise DeliveryTimeoutError(
                            "local producer queue stayed full; broker unreachable?"
                        ) from None
                    poll(0.01)
        expected = len(records)
        while len(acks.reports) < expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeliveryTimeoutError(
                    f"{expected - len(acks.reports)} of {expected} records not acknowledged "
                    f"within {self._wait_s:.0f}s; they may still be written (outcome unknown)"
                )
            poll(min(remaining, 0.1))
        if acks.errors:
            err, topic = acks.errors[0]
            hint = ""
            if err.code() in (
                KafkaError._MSG_TIMED_OUT,
                KafkaError._UNKNOWN_TOPIC,
                KafkaError.UNKNOWN_TOPIC_OR_PART,
            ):
                hint = f" (does topic {topic!r} exist? topics are not auto-created)"
            raise DeliveryError(
                f"{len(acks.errors)} of {expected} records not written to {topic}: "
                f"{err.name()}: {err.str()}{hint}",
                err,
            )

    def close(self) -> None:
        """Flush what is queued (bounded by the delivery timeout)."""
        remaining = self._producer.flush(self._wait_s)
        if remaining:
            log.error("%d records still unacknowledged when the producer closed", remaining)

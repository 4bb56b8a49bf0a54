"""Event → record: the one place that decides a record's topic, key, value and headers.

Every writer of opledger's topics (the SDK, the recovery and delivery workers, the redrive and
policy commands, the demo's set-up) builds its records here, so the wire format cannot drift
between them: ``tests/unit/test_one_way_to_the_log.py`` fails if a module outside ``ledger.log``
encodes an event or builds a record, and ``tests/integration/test_record_headers.py`` reads the
headers back from the topics after a demo run.

The headers every record carries:

- ``opledger-schema``: the Avro record name of the value (``ExecutionTransitioned``...), so a
  reader can route a record without decoding it;
- ``opledger-tenant``: the tenant the event belongs to (a reader may filter without decoding);
- ``opledger-writer``: which kind of process wrote it (:data:`WRITERS`), for auditors.

The W3C ``traceparent`` header is reserved for a trace context (:data:`TRACE_HEADER`); nothing
writes it yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from ledger.codec import Codec
from ledger.domain.events import DeliveryTransitioned, LedgerEvent, PolicyChanged
from ledger.kafka import MESSAGE_MAX_BYTES
from ledger.settings import Settings

SCHEMA_HEADER: Final = "opledger-schema"
TENANT_HEADER: Final = "opledger-tenant"
WRITER_HEADER: Final = "opledger-writer"
#: Reserved for a W3C trace context; no writer sets it yet.
TRACE_HEADER: Final = "traceparent"

#: The kinds of process that write events. A header value, so auditors can tell a record the
#: SDK appended from one a worker or a person's command appended.
WRITERS: Final = frozenset({"sdk", "recovery", "delivery", "redrive", "policy", "demo"})

Headers = list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """One record to append: topic, key, encoded value, headers; ``partition`` only where the
    record must go back where it came from (a redrive), else the key decides."""

    topic: str
    key: bytes
    value: bytes
    headers: Headers
    partition: int | None = None


#: Headers of a record that is not an event: whatever its owner's contract carries.
RawHeaders = list[tuple[str, str | bytes | None]]


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A record that is not an event, produced as it is: a dead letter (another record's own
    key, value and headers, with why and where from), a record redriven to where it came from,
    a key-store entry. Its contract belongs to the module that builds it; how it is sent and
    acknowledged belongs here (:class:`~ledger.log.send.RawWriter`)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: RawHeaders
    partition: int | None = None


#: Where acknowledged records were written: (topic, partition, offset) each.
Positions = list[tuple[str, int, int]]


@dataclass(frozen=True, slots=True)
class LogTopics:
    """Which topic each kind of event goes to."""

    execution: str
    delivery: str
    policy: str

    @classmethod
    def of(cls, settings: Settings) -> LogTopics:
        return cls(settings.execution_topic, settings.delivery_topic, settings.policy_topic)


class RecordBuilder:
    """Turns events into the records one kind of writer appends."""

    __slots__ = ("_codec", "_topics", "_writer")

    def __init__(self, topics: LogTopics, codec: Codec, writer: str) -> None:
        if writer not in WRITERS:
            raise ValueError(f"unknown writer kind {writer!r}; one of {sorted(WRITERS)}")
        self._topics = topics
        self._codec = codec
        self._writer = writer.encode("ascii")

    def record(self, event: LedgerEvent) -> OutgoingRecord:
        """``event`` as the record its topic holds: operation events keyed by operation id
        (deliveries on the delivery topic; executions, ownership changes and decisions on the
        execution topic, ordered with the transitions they govern), policy changes keyed by the
        subject they decide."""
        if isinstance(event, PolicyChanged):
            topic, key = self._topics.policy, event.subject_key()
        elif isinstance(event, DeliveryTransitioned):
            topic, key = self._topics.delivery, event.operation_id.encode("ascii")
        else:
            topic, key = self._topics.execution, event.operation_id.encode("ascii")
        headers = [
            (SCHEMA_HEADER, type(event).__name__.encode("ascii")),
            (TENANT_HEADER, event.tenant_id.encode("utf-8")),
            (WRITER_HEADER, self._writer),
        ]
        return OutgoingRecord(topic, key, self._codec.encode(event), headers)

    def records(self, events: Iterable[LedgerEvent]) -> list[OutgoingRecord]:
        return [self.record(event) for event in events]


def payload_record(topic: str, operation_id: str, body: bytes, headers: Headers) -> OutgoingRecord:
    """A delivered result on a destination's queue topic (the delivery worker's send to a queue
    destination): its body and headers are the queue contract of ``processors.delivery``,
    keyed by operation id so a consumer's partition holds all of an operation's results."""
    return OutgoingRecord(topic, operation_id.encode("ascii"), body, headers)


# What librdkafka adds to a record's key and value when it checks ``message.max.bytes``
# (RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD), and per header (two varints, at most 5 bytes each).
_RECORD_OVERHEAD = 36
_HEADER_OVERHEAD = 10


def record_size(record: OutgoingRecord) -> int:
    """The size librdkafka holds against ``message.max.bytes`` (rounded up a little)."""
    headers = sum(len(name) + len(value) + _HEADER_OVERHEAD for name, value in record.headers)
    return _RECORD_OVERHEAD + len(record.key) + len(record.value) + headers


def fits(record: OutgoingRecord) -> bool:
    """Whether the producer may send ``record`` at all."""
    return record_size(record) <= MESSAGE_MAX_BYTES

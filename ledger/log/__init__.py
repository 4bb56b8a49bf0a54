"""The one way to the log: events become records here (:mod:`ledger.log.records`), are sent and
acknowledged here under one resend policy (:mod:`ledger.log.send`; records that are not events,
such as dead letters and key-store entries, through its :class:`~ledger.log.send.RawWriter`),
and the log's ends are read here under one policy for a cluster that is moving
(:mod:`ledger.log.reads`). Kafka clients are constructed in :mod:`ledger.log.clients` only.
"""

from ledger.log.clients import new_admin, new_consumer, new_producer, producer_from
from ledger.log.reads import (
    LogUnavailableError,
    end_offsets,
    latest_offsets,
    offsets_at,
    read_range,
    ride_out,
    settling,
    watermarks,
)
from ledger.log.records import (
    SCHEMA_HEADER,
    TENANT_HEADER,
    TRACE_HEADER,
    WRITER_HEADER,
    LogTopics,
    OutgoingRecord,
    Positions,
    RawRecord,
    RecordBuilder,
    fits,
    payload_record,
    record_size,
)
from ledger.log.send import (
    DEFAULT_DELIVERY_TIMEOUT_S,
    KafkaTransport,
    LogWriter,
    RawSent,
    RawWriter,
    SplitTransport,
    Transport,
)

__all__ = [
    "DEFAULT_DELIVERY_TIMEOUT_S",
    "SCHEMA_HEADER",
    "TENANT_HEADER",
    "TRACE_HEADER",
    "WRITER_HEADER",
    "KafkaTransport",
    "LogTopics",
    "LogUnavailableError",
    "LogWriter",
    "OutgoingRecord",
    "Positions",
    "RawRecord",
    "RawSent",
    "RawWriter",
    "RecordBuilder",
    "SplitTransport",
    "Transport",
    "end_offsets",
    "fits",
    "latest_offsets",
    "new_admin",
    "new_consumer",
    "new_producer",
    "offsets_at",
    "payload_record",
    "producer_from",
    "read_range",
    "record_size",
    "ride_out",
    "settling",
    "watermarks",
]

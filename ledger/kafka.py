"""The one place that builds Kafka client configurations, and where librdkafka's log goes.

Every confluent-kafka producer, consumer and admin client opledger creates takes its
configuration from here (``tests/unit/test_kafka_config_factory.py`` checks the source), so
durability (idempotence, acks), partitioning (murmur2, as Java clients) and logging are decided
once; ``ledger.log.clients`` constructs every client from them.

librdkafka's own log is routed into Python logging (logger ``opledger.kafka``) instead of
stderr, and a repeated line - a client retrying a dead broker logs one every second or so - is
written once, then summarised, instead of flooding the log.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

from ledger.settings import Settings

#: How long a librdkafka line that repeats (digits aside) stays quiet after it was written.
REPEAT_QUIET_S = 60.0

# confluent-kafka maps librdkafka's syslog levels to Python's before calling us. librdkafka logs
# routine connection failures (which it retries by itself) at ERR; they are warnings to us: an
# error that matters reaches the caller through a delivery report or error_cb.
_DOWNGRADE = {logging.ERROR: logging.WARNING}

_DIGITS = re.compile(r"\d+")


class _RepeatFilter(logging.Filter):
    """Lets a line through once per :data:`REPEAT_QUIET_S`; counts what it held back."""

    def __init__(self, quiet_s: float = REPEAT_QUIET_S) -> None:
        super().__init__()
        self._quiet_s = quiet_s
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        # "after 1003ms", ports and broker ids change between repeats of the same complaint.
        shape = _DIGITS.sub("#", record.getMessage())
        now = time.monotonic()
        with self._lock:
            last = self._last.get(shape)
            if last is not None and now - last[0] < self._quiet_s:
                self._last[shape] = (last[0], last[1] + 1)
                return False
            held = 0 if last is None else last[1]
            self._last[shape] = (now, 0)
            if len(self._last) > 1000:  # a bounded memory of shapes, oldest forgotten
                oldest = min(self._last, key=lambda k: self._last[k][0])
                del self._last[oldest]
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {self._quiet_s:.0f}s)"
        return True


class _LibrdkafkaLogger(logging.LoggerAdapter[logging.Logger]):
    """What confluent-kafka calls as ``logger.log(level, "%s [%s] %s", facility, client, text)``."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.log(_DOWNGRADE.get(level, level), msg, *args, **kwargs)


_log = logging.getLogger("opledger.kafka")
_log.addFilter(_RepeatFilter())
KAFKA_LOGGER = _LibrdkafkaLogger(_log, {})


class KafkaCredentialsError(RuntimeError):
    """The broker asks for a password this process does not have."""


def _password(path: Path) -> str:
    try:
        first = path.read_text().splitlines()
    except FileNotFoundError:
        raise KafkaCredentialsError(
            f"no Kafka password at {path}: `opledger stack up` makes the local stack's, "
            "or set OPLEDGER_KAFKA_PASSWORD_FILE"
        ) from None
    if not first or not first[0].strip():
        raise KafkaCredentialsError(f"the Kafka password file {path} is empty")
    return first[0].strip()


def connection_config(settings: Settings) -> dict[str, Any]:
    """Where the broker is and how to prove who we are: the part of every client's
    configuration that tools outside the package (tests, benchmarks) must also use."""
    protocol = settings.kafka_security_protocol
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        "security.protocol": protocol,
    }
    if protocol.startswith("sasl_"):
        config["sasl.mechanism"] = settings.kafka_sasl_mechanism
        config["sasl.username"] = settings.kafka_user
        config["sasl.password"] = _password(settings.kafka_password_path)
    if protocol == "sasl_ssl" and settings.kafka_ca_file:
        config["ssl.ca.location"] = settings.kafka_ca_file
    return config


def _common(settings: Settings, client_id: str) -> dict[str, Any]:
    return {
        **connection_config(settings),
        "client.id": client_id,
        "logger": KAFKA_LOGGER,
        # A restarted broker comes back on the same address; reconnect quickly but not in a
        # tight loop (librdkafka backs off exponentially between these bounds).
        "reconnect.backoff.ms": 100,
        "reconnect.backoff.max.ms": 2000,
    }


#: The largest record a producer sends (librdkafka's ``message.max.bytes``, its default made
#: explicit): the broker's own default limit (``message.max.bytes``, 1,048,588) is above it.
MESSAGE_MAX_BYTES = 1_000_000


def producer_config(
    settings: Settings,
    *,
    client_id: str = "opledger-producer",
    delivery_timeout_s: float = 10.0,
    linger_ms: float = 0.0,
    compression: str = "lz4",
) -> dict[str, Any]:
    """A producer whose acknowledgement means "durable, once, in order".

    ``linger_ms`` is 0 by default: a caller waits for each acknowledgement, and a batching delay
    that one call cannot use would be a floor under every step (``bench/README.md``). Under
    concurrency librdkafka still batches whatever queued while a request was in flight.
    """
    return {
        **_common(settings, client_id),
        # Idempotence + acks=all: a retry inside the client cannot duplicate or reorder a record,
        # and "acknowledged" means written to every in-sync replica.
        "enable.idempotence": True,
        "acks": "all",
        "max.in.flight.requests.per.connection": 5,
        "linger.ms": linger_ms,
        "compression.type": compression,
        "message.max.bytes": MESSAGE_MAX_BYTES,
        # Upper bound on a call: without it a missing topic or a dead broker would make a
        # caller hang for librdkafka's default of 300 s.
        "delivery.timeout.ms": int(delivery_timeout_s * 1000),
        # Java's default partitioner (murmur2): Java consumers computing key -> partition agree
        # with us, and the execution and delivery topics (same partition count) put one
        # operation's records on the same partition number.
        "partitioner": "murmur2_random",
    }


def consumer_config(
    settings: Settings, *, group_id: str, client_id: str = "opledger-consumer"
) -> dict[str, Any]:
    """A consumer that commits nothing by itself: every worker stores its position with its
    effects and decides when Kafka's own offsets move."""
    return {
        **_common(settings, client_id),
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        # Transactional writers (none yet) would otherwise expose aborted records.
        "isolation.level": "read_committed",
    }


def admin_config(settings: Settings, *, client_id: str = "opledger-admin") -> dict[str, Any]:
    """An admin client (topic creation, metadata, watermarks)."""
    return _common(settings, client_id)


#: Keys up to this long (operation ids are 29 bytes) have their partition remembered.
_CACHED_KEY_BYTES = 64


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Java's default partitioner (and librdkafka's ``murmur2_random`` for a
    non-empty key) puts ``key`` on: ``toPositive(murmur2(key)) % partitions``. Readers use it to
    find an operation's records without scanning every partition."""
    # Every event of an operation asks again (the projector checks each record's partition,
    # the history reader each operation's): murmur2 in Python costs about fifty cache hits.
    if len(key) <= _CACHED_KEY_BYTES:
        return _remembered_partition(key, partitions)
    return _murmur2_partition(key, partitions)


@functools.lru_cache(maxsize=1 << 16)
def _remembered_partition(key: bytes, partitions: int) -> int:
    return _murmur2_partition(key, partitions)


def _murmur2_partition(key: bytes, partitions: int) -> int:
    m, r, mask = 0x5BD1E995, 24, 0xFFFFFFFF
    length = len(key)
    h = (0x9747B28C ^ length) & mask
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(key[i : i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= key[base + 2] << 16
    if tail >= 2:
        h ^= key[base + 1] << 8
    if tail >= 1:
        h ^= key[base]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


#: How long a consumer may fetch nothing before the broker is asked whether records wait.
FETCH_STALL_S = 20.0


def records_waiting(
    consumer: Any, positions: dict[tuple[str, int], int], timeout: float = 2.0
) -> list[str]:
    """The partitions of ``positions`` (topic, partition -> next offset to read) whose end on
    the broker, asked fresh (not the fetcher's cached watermarks), is beyond the position, as
    ``topic[partition]: position < end``. Empty when the broker does not answer: whoever asks
    learns that the broker is away by its own path.

    Why ask: librdkafka's consumer now and then stops fetching after a broker restart, on
    assigned and subscribed partitions alike, until it is recreated
    (confluentinc/librdkafka#5153, #4492; fede1024/rust-rdkafka#597). It logs nothing and
    fails nothing; only the broker can tell it apart from a quiet topic."""
    from confluent_kafka import KafkaException, TopicPartition  # noqa: PLC0415

    behind = []
    try:
        for (topic, partition), position in positions.items():
            _low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=timeout, cached=False
            )
            if int(high) > position:
                behind.append(f"{topic}[{partition}]: {position} < {int(high)}")
    except KafkaException:
        return []
    return behind


def listed(items: list[str], shown: int = 5) -> str:
    """``items`` for a log line: the first ``shown``, then how many more."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


class FetchStallClock:
    """When a consumer that has fetched nothing should ask the broker whether records wait
    (:func:`records_waiting`): once per ``bound_s`` without a record; the bound doubles after a
    remedy that brought nothing (up to 10 minutes), so a tail the fetcher rightly never returns
    costs a request now and then, not a loop of remedies."""

    def __init__(self, bound_s: float = FETCH_STALL_S) -> None:
        self._base_s = bound_s
        self.bound_s = bound_s
        self._since = time.monotonic()

    def arrived(self) -> None:
        """Records came: the fetcher works."""
        self._since = time.monotonic()
        self.bound_s = self._base_s

    def look_due(self) -> bool:
        """True at most once per bound without a record: time to ask the broker."""
        now = time.monotonic()
        if now - self._since < self.bound_s:
            return False
        self._since = now
        return True

    def remedied(self) -> None:
        """The consumer was recreated; if that brings nothing either, wait longer to look."""
        self.bound_s = min(self.bound_s * 2, 600.0)

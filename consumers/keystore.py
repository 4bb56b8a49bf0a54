"""The compacted key store: every key a consumer accepted, on a Kafka topic.

Its records are fed from the inbox commit (:class:`KeyStorePublisher`), never written before it:
a key on the topic always names a change that was committed. A consumer instance reads the
whole topic back on start (:func:`restore`) into a :class:`KeyView`, so a new replica, or one
whose database was wiped, still refuses every key accepted before.

Record layout (``ledger.topics.consumer_keys_topic_spec``, ``cleanup.policy=compact``):

- key: ``{consumer}/{operation_id}`` (:func:`record_key`): compaction keeps one record per
  consumer and operation, so consumers sharing the topic never erase each other's keys;
- partition: the murmur2 partition of the operation id alone (:func:`partition_of`), the one its
  execution and delivery records are on: co-partitioned with the ledger's topics;
- value: canonical JSON ``{"accepted_at", "consumer", "fingerprint", "operation_id",
  "outcome", "v": 1}``; no tombstones are written (the window is forever, see
  docs/decisions/009-consumer-dedup.md), but one would be honoured on restore.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from psycopg_pool import ConnectionPool

from ledger.domain.ids import OPERATION_ID_RE, canonical_json
from ledger.kafka import partition_for
from ledger.log import RawRecord, RawWriter, new_consumer, producer_from, watermarks
from ledger.pg import DatabaseError, DatabaseUnavailableError, retrying
from ledger.settings import Settings

log = logging.getLogger("opledger.consumer.keystore")

RECORD_VERSION = 1


def record_key(consumer: str, operation_id: str) -> bytes:
    """The key-store record key. A durable contract: compaction keeps the last record per key
    and restore parses it, so never change this format."""
    return f"{consumer}/{operation_id}".encode()


def partition_of(operation_id: str, partitions: int) -> int:
    """Where an operation's key goes: the partition of its ledger records (murmur2 of the
    operation id, as Java clients compute it)."""
    return partition_for(operation_id.encode(), partitions)


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One accepted key: which consumer, which operation, the body's fingerprint, when and
    with what outcome the change was committed."""

    consumer: str
    operation_id: str
    fingerprint: bytes
    accepted_at: datetime
    outcome: str

    def encode(self) -> bytes:
        return canonical_json(
            {
                "v": RECORD_VERSION,
                "consumer": self.consumer,
                "operation_id": self.operation_id,
                "fingerprint": "sha256:" + self.fingerprint.hex(),
                "accepted_at": self.accepted_at.astimezone(UTC).isoformat(),
                "outcome": self.outcome,
            }
        )


class KeyRecordError(ValueError):
    """A key-store record that does not follow the layout."""


def decode_entry(key: bytes, value: bytes) -> KeyEntry:
    """The entry a record holds, checked against its key; raises :class:`KeyRecordError`."""
    try:
        data = json.loads(value)
        consumer, operation_id = data["consumer"], data["operation_id"]
        text = data["fingerprint"]
        entry = KeyEntry(
            consumer,
            operation_id,
            bytes.fromhex(text.removeprefix("sha256:")) if text.startswith("sha256:") else b"",
            datetime.fromisoformat(data["accepted_at"]),
            str(data["outcome"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyRecordError(f"unreadable key-store record: {type(exc).__name__}") from None
    if len(entry.fingerprint) != 32 or not OPERATION_ID_RE.fullmatch(entry.operation_id):
        raise KeyRecordError("key-store record without a valid fingerprint or operation id")
    if record_key(entry.consumer, entry.operation_id) != key:
        raise KeyRecordError("key-store record whose key does not name its consumer and operation")
    return entry


def restored_fingerprint(consumer: str, operation_id: str, value: bytes) -> bytes:
    """The fingerprint a record of ``consumer``'s key ``operation_id`` holds: what restore
    keeps. Checks that the value names the same consumer and operation, but skips the rest of
    :func:`decode_entry`.

    Records in the publisher's own canonical layout (sorted keys, no spaces) are read by
    position: ``json.loads`` was most of a restore's time (``bench_consumer_restore.py``).
    Anything else is parsed as JSON."""
    middle = b'","consumer":"' + consumer.encode() + b'","fingerprint":"sha256:'
    at = value.find(middle)
    if at > 0 and value.startswith(b'{"accepted_at":"'):
        start = at + len(middle)
        tail = b'","operation_id":"' + operation_id.encode() + b'","outcome":"'
        if value.startswith(tail, start + 64):
            try:
                return bytes.fromhex(value[start : start + 64].decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                pass  # not hex: let the JSON path say what is wrong
    try:
        data = json.loads(value)
        text = data["fingerprint"]
        same = data["consumer"] == consumer and data["operation_id"] == operation_id
        digest = bytes.fromhex(text[7:]) if text.startswith("sha256:") else b""
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyRecordError(f"unreadable key-store record: {type(exc).__name__}") from None
    if not same or len(digest) != 32:
        raise KeyRecordError("key-store record whose value does not match its key")
    return digest


#: Consumer settings of a restore (and of its benchmark's raw baseline).
RESTORE_FETCH = {
    "max.partition.fetch.bytes": 8 * 1024 * 1024,
    "fetch.max.bytes": 64 * 1024 * 1024,
    "fetch.wait.max.ms": 20,
    # Prefetched data per partition: with librdkafka's 64 MB a 1M-key restore grew the process
    # by ~510 MiB, with 16 MB by ~210 MiB, about the view itself (bench_consumer_restore.py).
    "queued.max.messages.kbytes": 16 * 1024,
}


class KeyView:
    """One consumer's accepted keys in memory: operation id -> fingerprint. Filled by
    :func:`restore`, then by the instance's own accepts; used from one thread at a time."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}

    def get(self, operation_id: str) -> bytes | None:
        return self._keys.get(operation_id)

    def put(self, operation_id: str, fingerprint: bytes) -> None:
        self._keys[operation_id] = fingerprint

    def discard(self, operation_id: str) -> None:
        self._keys.pop(operation_id, None)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, operation_id: object) -> bool:
        return operation_id in self._keys


@dataclass(frozen=True, slots=True)
class RestoreReport:
    keys: int
    records: int
    skipped: int
    seconds: float


class RestoreError(RuntimeError):
    """The key store could not be read to its end; the instance must not serve."""


def _watermarks(reader: Consumer, tp: TopicPartition, deadline: float) -> tuple[int, int]:
    try:
        return watermarks(reader, tp, deadline)
    except KafkaException as exc:
        raise RestoreError(f"cannot read the key store's end offsets: {exc}") from exc


def restore(
    settings: Settings,
    consumer: str,
    view: KeyView,
    *,
    timeout_s: float = 600.0,
    batch: int = 10_000,
) -> RestoreReport:
    """Read the key store from its beginning to the end offsets it has now, keeping
    ``consumer``'s keys in ``view``. Other consumers' records are skipped by their key alone."""
    started = time.monotonic()
    topic = settings.consumer_keys_topic
    reader = new_consumer(
        settings,
        # Never joins or commits: assign() only. A group id is still required by librdkafka.
        group_id=f"{settings.topic_prefix}-keystore-restore",
        client_id=f"opledger-keystore-restore-{consumer}",
        # Larger fetches than librdkafka's 1 MB per partition: fewer round trips for a read
        # that only ever goes to the end (bench/bench_consumer_restore.py gives its baseline
        # the same).
        overrides=RESTORE_FETCH,
    )
    prefix = f"{consumer}/".encode()
    cut = len(prefix)
    keys = view._keys  # the hot loop writes the dict directly
    records = skipped = 0
    try:
        deadline = started + timeout_s
        while True:
            metadata = reader.list_topics(topic, timeout=10).topics.get(topic)
            if metadata is not None and metadata.error is None:
                break
            # A topic created a moment ago may still report no leader; a missing one stays so.
            if time.monotonic() > min(deadline, started + 15):
                raise RestoreError(
                    f"key-store topic {topic} is missing or has no leader: run "
                    "ledger.topics.ensure_topics (or `opledger stack up`)"
                )
            time.sleep(0.2)
        ends: dict[int, int] = {}
        for partition in metadata.partitions:
            low, high = _watermarks(reader, TopicPartition(topic, partition), deadline)
            if high > low:  # an empty partition has nothing to wait for (faust issue 597)
                ends[partition] = high
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        remaining = set(ends)
        while remaining:
            if time.monotonic() > deadline:
                raise RestoreError(
                    f"key store not read to its end within {timeout_s:.0f}s "
                    f"({len(remaining)} partitions left)"
                )
            messages = reader.consume(batch, 0.5)
            if not messages:
                # Our writer is never transactional, but a control record or compacted tail
                # would leave the last offset unseen: the fetch position says where we are.
                for tp in reader.position([TopicPartition(topic, p) for p in remaining]):
                    if tp.offset >= ends[tp.partition]:
                        remaining.discard(tp.partition)
                continue
            for message in messages:
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RestoreError(f"reading the key store failed: {error.str()}")
                records += 1
                key = message.key()
                if key is not None and key[:cut] == prefix:
                    value = message.value()
                    if value is None:  # a tombstone: the key left the window
                        keys.pop(key[cut:].decode(), None)
                    else:
                        operation_id = key[cut:].decode()
                        try:
                            keys[operation_id] = restored_fingerprint(consumer, operation_id, value)
                        except KeyRecordError as exc:
                            skipped += 1
                            log.error(
                                "key-store record %s[%d]@%d skipped: %s",
                                topic,
                                message.partition(),
                                message.offset(),
                                exc,
                            )
                partition, offset = message.partition(), message.offset()
                if partition in remaining and (offset or 0) >= ends[partition] - 1:
                    remaining.discard(partition)
    finally:
        reader.close()
    return RestoreReport(len(view), records, skipped, time.monotonic() - started)


#: How long the publisher waits for room when the producer's local queue is full, serving
#: acknowledgements meanwhile, before it turns to its other work and tries again.
QUEUE_FULL_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class _Acked:
    operation_id: str
    lag_s: float  # inbox commit -> broker acknowledgement


_SELECT_UNPUBLISHED = """
SELECT operation_id, fingerprint, received_at, outcome
  FROM consumer_inbox
 WHERE consumer = %s AND NOT published AND received_at <= now() - make_interval(secs => %s)
 ORDER BY received_at
 LIMIT %s
"""
_MARK_PUBLISHED = """
UPDATE consumer_inbox SET published = true, published_at = clock_timestamp()
 WHERE consumer = %s AND operation_id = ANY(%s) AND NOT published
"""
_COUNT_UNPUBLISHED = "SELECT count(*) FROM consumer_inbox WHERE consumer = %s AND NOT published"


class KeyStorePublisher:
    """Writes accepted keys to the key store after their inbox commit, and marks them
    published once the broker has them.

    :meth:`publish` queues a key right after its commit. A background thread produces what is
    queued, serves the acknowledgements, marks those rows published in batches, and every
    ``sweep_interval_s`` republishes rows still unpublished after ``sweep_grace_s``: a crash
    between the commit and the acknowledgement (or a refused record) loses nothing, it only
    delays the key. Republishing a key twice is harmless: compaction keeps one.
    """

    def __init__(
        self,
        settings: Settings,
        consumer: str,
        pool: ConnectionPool[Any],
        *,
        on_lag: Callable[[float], None] = lambda _s: None,
        on_unpublished: Callable[[int], None] = lambda _n: None,
        on_republished: Callable[[int], None] = lambda _n: None,
        on_failure: Callable[[], None] = lambda: None,
        sweep_interval_s: float = 5.0,
        sweep_grace_s: float = 5.0,
        producer_factory: Callable[[dict[str, Any]], Any] = producer_from,
    ) -> None:
        self._topic = settings.consumer_keys_topic
        self._partitions = settings.partitions
        self._consumer = consumer
        self._pool = pool
        self._on_lag = on_lag
        self._on_unpublished = on_unpublished
        self._on_republished = on_republished
        self._on_failure = on_failure
        self._sweep_interval_s = sweep_interval_s
        self._sweep_grace_s = sweep_grace_s
        # A 10 ms linger: the key store is not on the answer's path, and fewer, larger batches
        # mean fewer acknowledgements to wake this process's Python thread for.
        self._writer = RawWriter(
            settings,
            client_id=f"opledger-keystore-{consumer}",
            linger_ms=10,
            producer_factory=producer_factory,
        )
        # Filled by delivery callbacks: in the publisher thread, or in whoever calls flush().
        self._acked: list[_Acked] = []
        self._acked_lock = threading.Lock()
        self._pending: collections.deque[KeyEntry] = collections.deque()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()

    # -- called by request handlers -------------------------------------------------------------

    def publish(self, entry: KeyEntry) -> None:
        """Queue ``entry`` (committed in the inbox) for the publisher thread; never blocks.
        The request path only appends: encoding and producing happen in that thread, in bulk."""
        self._pending.append(entry)

    def _produce_pending(self) -> None:
        while True:
            try:
                entry = self._pending.popleft()  # flush() may drain from another thread
            except IndexError:
                return
            record = RawRecord(
                self._topic,
                record_key(entry.consumer, entry.operation_id),
                entry.encode(),
                [],
                partition_of(entry.operation_id, self._partitions),
            )
            if not self._writer.submit(record, self._reporter(entry), wait_s=QUEUE_FULL_WAIT_S):
                # librdkafka's queue stayed full (the broker is slow or away): the key waits
                # at the head of the queue for the next turn, which serves acknowledgements
                # and sweeps meanwhile; a crash now loses nothing, the row is unpublished.
                self._pending.appendleft(entry)
                return

    def _reporter(self, entry: KeyEntry) -> Callable[[KafkaError | None, Any], None]:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                self._on_failure()
                log.warning("key-store record not written (the sweep retries it): %s", err.str())
                return
            lag = time.time() - entry.accepted_at.timestamp()
            with self._acked_lock:
                self._acked.append(_Acked(entry.operation_id, max(0.0, lag)))

        return delivered

    # -- the background thread ------------------------------------------------------------------

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._serve, name="opledger-keystore-publisher", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        next_sweep = 0.0  # the first sweep runs at once: it republishes what a crash left
        last_mark = time.monotonic()
        while not self._closing.is_set():
            self._produce_pending()
            self._writer.poll(0.01)
            now = time.monotonic()
            if self._acked and (len(self._acked) >= 1000 or now - last_mark >= 0.1):
                self._mark()
                last_mark = now
            if now >= next_sweep:
                # The first sweep republishes what a crash left: rows committed before this
                # publisher started, not the ones being received now, whose acknowledgement
                # is on its way (republished, each key reached the store twice).
                grace = now - self._started if next_sweep == 0.0 else self._sweep_grace_s
                try:
                    self.sweep(grace)
                except (DatabaseUnavailableError, DatabaseError) as exc:
                    log.warning("key-store sweep failed, retrying later: %s", exc)
                next_sweep = now + self._sweep_interval_s

    def _mark(self) -> None:
        with self._acked_lock:
            acked, self._acked = self._acked, []
        ids = [a.operation_id for a in acked]
        try:
            retrying(
                self._pool,
                "mark keys published",
                lambda conn: conn.execute(_MARK_PUBLISHED, (self._consumer, ids)),
                window_s=2.0,
            )
        except (DatabaseUnavailableError, DatabaseError) as exc:
            # Still unpublished in the table: the sweep sends them again later.
            log.warning("could not mark %d keys published: %s", len(ids), exc)
            return
        for a in acked:
            self._on_lag(a.lag_s)

    def sweep(self, grace_s: float, limit: int = 5000) -> int:
        """Republish inbox rows still unpublished ``grace_s`` after their commit; returns how
        many. Called by the thread; tests and start-up may call it directly."""
        rows = retrying(
            self._pool,
            "find unpublished keys",
            lambda conn: conn.execute(
                _SELECT_UNPUBLISHED, (self._consumer, grace_s, limit)
            ).fetchall(),
            window_s=2.0,
        )
        for operation_id, digest, received_at, outcome in rows:
            self.publish(
                KeyEntry(self._consumer, operation_id, bytes(digest), received_at, outcome)
            )
        if rows:
            self._on_republished(len(rows))
            log.info("republished %d keys left unpublished (a crash or a refused write)", len(rows))
        count = retrying(
            self._pool,
            "count unpublished keys",
            lambda conn: conn.execute(_COUNT_UNPUBLISHED, (self._consumer,)).fetchone(),
            window_s=2.0,
        )
        self._on_unpublished(int(count[0]) if count else 0)
        return len(rows)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every handed-over key is acknowledged (and, with the thread stopped,
        marked); True if none is left."""
        self._produce_pending()
        left = self._writer.flush(timeout_s)
        if (self._thread is None or not self._thread.is_alive()) and self._acked:
            self._mark()
        return left == 0

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush(timeout_s)

"""The projector's read path: a confluent-kafka consumer polled in batches, beneath faust.

Why not a faust agent: its per-event path (``take`` or plain iteration alike) reads an order of
magnitude fewer events per second than a batch ``consume()`` loop, below the projector's target
(``bench/bench_read_path.py``; figures in ``bench/README.md``). faust still hosts this loop as
a service (worker lifecycle, signals, web /metrics); the loop just reads beneath the per-event
stream.

Partitions are assigned, not subscribed: positions live in PostgreSQL with the rows they produced,
so there is no group rebalance to wait for after a SIGKILL, and a restarted projector resumes at
exactly the committed position. Kafka's group offsets are committed afterwards for lag tooling only.

Nothing a topic holds can stop this loop:

- a record that cannot be decoded goes to the dead-letter topic with the reason;
- a batch the database refuses (a value it cannot store, a constraint) is split in halves until
  the culprit is alone; the rest commits, the culprit is dead-lettered with PostgreSQL's reason;
- a record too large to republish is dead-lettered *by reference* (coordinates, size, digest,
  a prefix); the original stays on its topic;
- PostgreSQL or the broker going away is waited out with backoff, the batch kept and tried
  again, while ``/healthz`` says the projector is not progressing;
- a consumer that stops fetching while records wait (librdkafka's assigned consumer, after a
  broker restart, now and then: confluentinc/librdkafka#5153, fede1024/rust-rdkafka#597) is
  reopened from the positions stored with the rows, as a restarted process would be.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from ledger.codec import Codec, DecodeError
from ledger.dead_letters import (
    DeadLetterUnavailableError,
    by_reference,
    needs_reference,
    send_dead_letters,
)
from ledger.domain.events import LedgerEvent, PolicyChanged
from ledger.faults import fault_point
from ledger.kafka import (
    FETCH_STALL_S,
    FetchStallClock,
    listed,
    partition_for,
    records_waiting,
)
from ledger.log import RawWriter, new_consumer
from ledger.metrics import Metrics
from ledger.policy_keys import trusted_keys
from ledger.records import (
    Coordinates,
    DeadLetter,
    ProjectionBatch,
    ProjectionReport,
    ProjectionSink,
    RecordRefusedError,
    SinkUnavailableError,
    SourcedEvent,
    SourcedPolicyChange,
)
from ledger.settings import Settings
from processors.health import Health

log = logging.getLogger("opledger.projector")

_MACHINES = ("execution", "delivery", "control")

_UNREACHABLE = (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE)


class ProjectorError(RuntimeError):
    """The projector cannot go on (topics missing, a fatal client error, the dead-letter path
    itself refused): the worker exits and its supervisor restarts it."""


@dataclass(frozen=True, slots=True)
class ReaderConfig:
    consumer_name: str
    topics: tuple[str, ...]
    execution_topic: str
    dead_letter_topic: str
    batch_size: int
    poll_timeout_s: float = 0.05


def reader_config(settings: Settings) -> ReaderConfig:
    return ReaderConfig(
        consumer_name=settings.projector_group,
        topics=(settings.execution_topic, settings.delivery_topic, settings.policy_topic),
        execution_topic=settings.execution_topic,
        dead_letter_topic=settings.dead_letter_topic,
        batch_size=settings.projector_batch,
    )


#: The kinds of event each topic carries: a transition of its machine, and on the execution
#: topic the ownership changes and decisions that must be ordered with it; on the policy topic,
#: policy changes only.
TOPIC_KINDS = {
    "execution": frozenset({"execution", "ownership", "decision"}),
    "delivery": frozenset({"delivery"}),
    "policy": frozenset({"policy"}),
}
#: Why a policy change may not count, or None when it may (``ledger.policy_keys``).
PolicyRefusal = Callable[[PolicyChanged], str | None]

#: How the policy topic's name ends (``Settings.policy_topic``: the prefix, then this).
POLICY_TOPIC_SUFFIX = ".policy.v1"


def classify(
    codec: Codec,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    timestamp_ms: int,
    partitions: int | None = None,
    policy_refusal: PolicyRefusal = lambda _change: "no trusted operator keys configured",
) -> SourcedEvent | SourcedPolicyChange | DeadLetter:
    """Decode one raw record at the edge; anything unusable becomes a dead letter with a reason.
    ``policy_refusal`` says why a policy change may not count (None: it may); by default none
    does (decision 032: only changes signed by a trusted operator key are folded).

    ``partitions`` (the operation topics' partition count) also refuses an operation record
    that is not on the partition its key maps to."""
    coords = Coordinates(topic, partition, offset)
    if value is None:
        return DeadLetter(coords, "empty record value", key, value, timestamp_ms)
    try:
        event = codec.decode(value)
    except DecodeError as exc:
        return DeadLetter(coords, str(exc), key, value, timestamp_ms)
    if topic.endswith(POLICY_TOPIC_SUFFIX):
        return _classify_policy(
            coords, event, key, value, timestamp_ms, policy_refusal=policy_refusal
        )
    machine = "execution" if ".execution." in topic else "delivery"
    # (isinstance only narrows the type: a policy change's kind is in neither set.)
    if event.kind not in TOPIC_KINDS[machine] or isinstance(event, PolicyChanged):
        return DeadLetter(
            coords, f"{event.kind} event on the {machine} topic", key, value, timestamp_ms
        )
    # One operation's history must live on one partition; a record keyed otherwise could be
    # folded out of order by another partition's batch, so it is refused rather than guessed at.
    if key != event.operation_id.encode():
        return DeadLetter(
            coords, "record key is not the event's operation_id", key, value, timestamp_ms
        )
    # Right key, wrong partition (a producer with librdkafka's default partitioner): it would
    # be folded apart from the rest of its operation's history, and a replay could order it
    # differently. Refused, like a wrong key.
    if partitions is not None and partition != partition_for(key, partitions):
        return DeadLetter(
            coords,
            f"record is on partition {partition}, but its key maps to "
            f"{partition_for(key, partitions)} (murmur2, as every opledger writer partitions)",
            key,
            value,
            timestamp_ms,
        )
    return SourcedEvent(coords, event, timestamp_ms)


def _classify_policy(
    coords: Coordinates,
    event: LedgerEvent,
    key: bytes | None,
    value: bytes,
    timestamp_ms: int,
    *,
    policy_refusal: PolicyRefusal,
) -> SourcedPolicyChange | DeadLetter:
    if not isinstance(event, PolicyChanged):
        reason = f"{event.kind} event on the policy topic"
        return DeadLetter(coords, reason, key, value, timestamp_ms)
    # Compaction keeps the last record per key: a record keyed otherwise than by the subject it
    # decides would outlive, or erase, another subject's state. Refused rather than guessed at.
    if key != event.subject_key():
        return DeadLetter(
            coords,
            "record key is not the policy change's subject "
            "(ledger.domain.policy.grant_key / credential_key)",
            key,
            value,
            timestamp_ms,
        )
    # Anyone the broker lets write the topic could grant itself any tool: a change counts only
    # when the operator's key signed it. Refused, it is dead-lettered and counted, never folded.
    refusal = policy_refusal(event)
    if refusal is not None:
        return DeadLetter(coords, f"policy change refused: {refusal}", key, value, timestamp_ms)
    return SourcedPolicyChange(coords, event, timestamp_ms)


@dataclass(frozen=True, slots=True)
class _Read:
    """One consumed record: what it decoded to, and its raw bytes (for the dead letters)."""

    item: SourcedEvent | SourcedPolicyChange | DeadLetter
    key: bytes | None
    value: bytes | None

    @property
    def coordinates(self) -> Coordinates:
        return self.item.coordinates


class BatchProjector:
    """Reads the execution, delivery and policy topics in batches and hands each batch to a
    :class:`ProjectionSink`."""

    def _policy_refusal(self, change: PolicyChanged) -> str | None:
        # Read per change (a stat when the file is unchanged): a key added to or removed from
        # the trusted file counts from the next change on, without a restart.
        return trusted_keys(self._settings).refuses(change)

    def __init__(
        self,
        settings: Settings,
        sink: ProjectionSink,
        codec: Codec,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        *,
        max_backoff_s: float = 5.0,
        fetch_stall_s: float = FETCH_STALL_S,
        rebuild: bool = False,
    ) -> None:
        """``rebuild``: a replay into a database of its own (``opledger replay``), which
        writes nothing to the log: its dead letters are stored as they would have been
        published, and it commits no group offset."""
        self._settings = settings
        self._rebuild = rebuild
        self._config = reader_config(settings)
        self._sink = sink
        self._codec = codec
        self._metrics = metrics
        self._clock = clock
        self._max_backoff_s = max_backoff_s
        self._consumer: Consumer | None = None
        self._dlq: RawWriter | None = None
        self._stopping = threading.Event()
        self._positions: dict[tuple[str, int], int] = {}
        self._lag_reported_at = 0.0
        self._ages_reported_at = 0.0
        # A batch read but not committed yet: kept across failures so nothing is skipped.
        self._pending: list[_Read] | None = None
        self._published: set[Coordinates] = set()
        self._backoff_s = 0.0
        self._kafka_down: KafkaError | None = None
        #: execution partition -> its end offset, as last asked for a held delivery
        self._execution_ends: dict[int, int] = {}
        #: paused delivery (topic, partition) -> execution position it waits for
        self._waiting: dict[tuple[str, int], int] = {}
        self._kafka_checked_at = 0.0
        self._fetch_stall = FetchStallClock(fetch_stall_s)
        self.health = Health("projector", unit="batches")

    @property
    def batches(self) -> int:
        return self.health.done

    def stop(self) -> None:
        self._stopping.set()

    # -- lifecycle --------------------------------------------------------------------------------

    def _open(self) -> Consumer:
        consumer = new_consumer(
            self._settings,
            group_id=self._config.consumer_name,
            client_id="opledger-projector",
            overrides={
                # Short, although the broker answers a fetch as soon as a record arrives: a seek
                # (a delivery partition rewound until its execution is projected) waits for the
                # fetch in flight, and a long wait made the refused-records test of
                # test_projector_hardening an order of magnitude slower (bench/README.md). The
                # price: an idle projector fetches 50 times a second.
                "fetch.wait.max.ms": 20,
                "queued.max.messages.kbytes": 65536,
                "error_cb": self._on_client_error,
            },
        )
        if not self._rebuild:
            self._dlq = RawWriter(
                self._settings,
                client_id="opledger-projector-dlq",
                delivery_timeout_s=30.0,
                linger_ms=5,
                on_client_error=self._on_client_error,
            )
        metadata = consumer.list_topics(timeout=10)
        assignment: list[TopicPartition] = []
        stored = self._sink.positions(self._config.consumer_name, self._config.topics)
        for topic in self._config.topics:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                raise ProjectorError(f"topic {topic} does not exist; run `opledger stack up` first")
            for partition in sorted(meta.partitions):
                offset = stored.get((topic, partition), OFFSET_BEGINNING)
                assignment.append(TopicPartition(topic, partition, offset))
                self._positions[(topic, partition)] = max(offset, 0)
        consumer.assign(assignment)
        log.info(
            "projector assigned %d partitions of %s, resuming from stored offsets",
            len(assignment),
            ", ".join(self._config.topics),
        )
        return consumer

    def _open_patiently(self) -> Consumer:
        """:meth:`_open`, waiting out a broker or database that is not up yet."""
        while True:
            try:
                return self._open()
            except (KafkaException, SinkUnavailableError) as exc:
                self._close_clients()
                if self._stopping.is_set():
                    raise ProjectorError("stopped before the projector could start") from exc
                self.health.stalled(f"starting: {exc}")
                log.warning("projector cannot start yet (%s); retrying", exc)
                self._wait_backoff()
                if isinstance(exc, SinkUnavailableError):
                    self._try_reconnect()

    def run(self, max_batches: int | None = None) -> None:
        """Poll, fold and commit until :meth:`stop` (or ``max_batches``, for tests)."""
        self._consumer = self._open_patiently()
        try:
            while not self._stopping.is_set() and (
                max_batches is None or self.batches < max_batches
            ):
                self.run_once()
        finally:
            self.close()

    def rebuild_to(
        self,
        cut: Mapping[tuple[str, int], int],
        on_progress: Callable[[int], None],
        timeout_s: float,
    ) -> None:
        """Fold from the stored positions (none, in a fresh database) until every partition of
        ``cut`` has been read up to its offset; ``on_progress`` hears how many of the cut's
        records are folded. Records past the cut may be folded too: ``projections.compare``
        leaves what they touched out."""
        self._consumer = self._open_patiently()
        deadline = time.monotonic() + timeout_s
        try:
            while not self._reached(cut):
                if time.monotonic() > deadline:
                    raise ProjectorError(
                        f"the rebuild did not reach the cut within {timeout_s:.0f}s: "
                        + listed(
                            [
                                f"{t}[{p}]: {self._positions.get((t, p), 0)} < {end}"
                                for (t, p), end in sorted(cut.items())
                                if self._positions.get((t, p), 0) < end
                            ]
                        )
                    )
                self.run_once()
                on_progress(sum(min(self._positions.get(key, 0), end) for key, end in cut.items()))
        finally:
            self.close()

    def _reached(self, cut: Mapping[tuple[str, int], int]) -> bool:
        if self._pending is not None or self._waiting:
            return False
        assert self._consumer is not None
        # The fetch position too: past a transaction's commit marker, which is no record.
        fetched = {
            (tp.topic, tp.partition): tp.offset
            for tp in self._consumer.position([TopicPartition(t, p) for t, p in cut])
        }
        return all(
            max(self._positions.get(key, 0), fetched.get(key, -1)) >= end
            for key, end in cut.items()
        )

    def close(self) -> None:
        self._close_clients()

    def _close_clients(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._dlq is not None:
            self._dlq.close(10)
            self._dlq = None

    # -- the loop ---------------------------------------------------------------------------------

    def run_once(self) -> ProjectionReport | None:
        """One batch: read (or take the batch a failure left pending), fold, commit."""
        assert self._consumer is not None, "run() opens the consumer"
        if self._pending is None:
            messages = self._consumer.consume(self._config.batch_size, self._config.poll_timeout_s)
            self._report_lag()
            self._report_open_ages()
            if messages:
                self._fetch_stall.arrived()
            reads = self._decode(messages)
            if not reads:
                self.health.beat()
                self._check_kafka()
                self._check_fetching()
                return None
            self._pending = reads
        try:
            report = self._project_reads(self._pending)
        except (SinkUnavailableError, KafkaException, DeadLetterUnavailableError) as exc:
            self.health.stalled(f"{type(exc).__name__}: {exc}")
            log.warning("projection paused, will retry the same batch: %s", exc)
            self._wait_backoff()
            if isinstance(exc, SinkUnavailableError):
                self._try_reconnect()
            return None
        self._pending = None
        self._published.clear()
        self._backoff_s = 0.0
        self._kafka_down = None
        self.health.ok()
        return report

    def _decode(self, messages: Sequence[Any]) -> list[_Read]:
        reads: list[_Read] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                if error.fatal():
                    raise ProjectorError(f"fatal consumer error: {error}")
                # Transport trouble and the like are retried by librdkafka itself.
                log.warning("consume: %s", error)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None:
                raise ProjectorError("consumed a record without coordinates")
            _, timestamp_ms = message.timestamp()
            key, value = message.key(), message.value()
            item = classify(
                self._codec,
                topic=topic,
                partition=partition,
                offset=offset,
                key=key,
                value=value,
                timestamp_ms=timestamp_ms,
                partitions=self._settings.partitions,
                policy_refusal=self._policy_refusal,
            )
            reads.append(_Read(item, key, value))
        return reads

    def _project_reads(self, reads: list[_Read]) -> ProjectionReport:
        """Commit ``reads`` in as few transactions as the sink accepts.

        A refused batch is split in halves (each half is a consistent cut: records keep their
        per-partition order) until the refused record is alone; it is then dead-lettered with the
        sink's reason, and everything else commits.
        """
        total = ProjectionReport()
        rewound: dict[tuple[str, int], int] = {}
        queue: deque[list[_Read]] = deque([reads])
        while queue:
            part = [r for r in queue.popleft() if not _behind_rewind(r, rewound)]
            if not part:
                continue
            try:
                report = self._commit(part)
            except RecordRefusedError as exc:
                if len(part) > 1:
                    middle = len(part) // 2
                    queue.appendleft(part[middle:])
                    queue.appendleft(part[:middle])
                    continue
                report = self._isolate(part[0], str(exc))
            _merge(total, report)
            rewound.update(report.rewind)
        for (topic, partition), offset in rewound.items():
            # Deliveries whose execution is not projected yet: read them again after it is,
            # and not before: the partition waits (paused) until the execution partition is
            # read up to where it ended when the deliveries were held.
            assert self._consumer is not None
            held = TopicPartition(topic, partition, offset)
            self._consumer.seek(held)
            self._positions[(topic, partition)] = offset
            needed = self._execution_ends.get(partition)
            if needed is not None:
                self._consumer.pause([held])
                self._waiting[(topic, partition)] = needed
        self._resume_waiting()
        return total

    def _resume_waiting(self) -> None:
        """Resume held delivery partitions whose execution partition has caught up."""
        if not self._waiting or self._consumer is None:
            return
        ready = [
            (topic, partition)
            for (topic, partition), needed in self._waiting.items()
            if self._positions.get((self._config.execution_topic, partition), 0) >= needed
        ]
        for key in ready:
            del self._waiting[key]
            held = TopicPartition(key[0], key[1], self._positions[key])
            self._consumer.resume([held])
            # A paused partition's fetch position is where it was seeked to; say it again in
            # case the pause raced the seek.
            self._consumer.seek(held)

    def _isolate(self, read: _Read, reason: str) -> ProjectionReport:
        """Dead-letter the one record the sink refused, and commit that (with its offset)."""
        c = read.coordinates
        log.error(
            "the database refused %s[%d]@%d; dead-lettering it: %s",
            c.topic,
            c.partition,
            c.offset,
            reason,
        )
        dead = DeadLetter(
            c,
            f"refused by the projection database: {reason}",
            read.key,
            read.value,
            read.item.timestamp_ms,
        )
        try:
            return self._commit([_Read(dead, read.key, read.value)])
        except RecordRefusedError as exc:
            # Even a dead-letter row cannot be stored: the database itself is the problem
            # (a missing table, a broken migration), not this record. Stop rather than
            # dead-letter everything that follows.
            raise ProjectorError(f"cannot store a dead letter either: {exc}") from exc

    def _commit(self, part: list[_Read]) -> ProjectionReport:
        started = time.perf_counter()
        events: list[SourcedEvent] = []
        dead: list[DeadLetter] = []
        policy: list[SourcedPolicyChange] = []
        next_offsets: dict[tuple[str, int], int] = {}
        for read in part:
            if isinstance(read.item, SourcedEvent):
                events.append(read.item)
            elif isinstance(read.item, DeadLetter):
                dead.append(read.item)
            else:
                policy.append(read.item)
            c = read.coordinates
            next_offsets[(c.topic, c.partition)] = c.offset + 1
        if dead and self._rebuild:
            # As the live projector stored them: the original stays on its topic either way.
            dead = [by_reference(d) if needs_reference(d) else d for d in dead]
        elif dead:
            dead = self._publish_dead_letters(dead)
        batch = ProjectionBatch(
            events,
            dead,
            next_offsets,
            execution_topic=self._config.execution_topic,
            execution_end=self._execution_end,
            policy_changes=policy,
        )
        fault_point("projector.before_commit")
        report = self._sink.project(self._config.consumer_name, batch)
        fault_point("projector.after_commit")
        committed = {k: report.rewind.get(k, n) for k, n in next_offsets.items()}
        assert self._consumer is not None
        try:
            if not self._rebuild:
                self._consumer.commit(
                    offsets=[TopicPartition(t, p, n) for (t, p), n in committed.items()],
                    asynchronous=True,
                )
        except KafkaException as exc:  # informational offsets only; PostgreSQL holds the truth
            log.debug("kafka offset commit skipped: %s", exc)
        self._positions.update(committed)
        self._observe(report, batch, time.perf_counter() - started)
        return report

    def _execution_end(self, partition: int) -> int:
        """The execution topic's current end offset for ``partition`` (one broker round trip,
        asked only for a delivery whose execution is not projected)."""
        assert self._consumer is not None
        _low, high = self._consumer.get_watermark_offsets(
            TopicPartition(self._config.execution_topic, partition), timeout=10, cached=False
        )
        self._execution_ends[partition] = int(high)
        return int(high)

    # -- failures -------------------------------------------------------------------------------

    def _on_client_error(self, err: KafkaError) -> None:
        if err.code() in _UNREACHABLE:
            if self._kafka_down is None:
                log.warning("kafka broker unreachable: %s", err.str())
            self._kafka_down = err
            self.health.stalled(f"Kafka broker unreachable: {err.str()}")

    def _check_kafka(self, every_s: float = 2.0) -> None:
        """While the broker was last seen down, ask it for metadata now and then; an answer means
        the projector can progress again (an idle consume cannot tell down from quiet)."""
        if self._kafka_down is None or self._consumer is None:
            return
        now = time.monotonic()
        if now - self._kafka_checked_at < every_s:
            return
        self._kafka_checked_at = now
        try:
            self._consumer.list_topics(timeout=1)
        except KafkaException:
            return
        log.info("kafka broker reachable again")
        self._kafka_down = None
        self.health.ok(done=0)

    def _check_fetching(self) -> None:
        """Nothing fetched for a while: ask the broker whether records wait. If they do, the
        fetcher is stuck (it logs nothing and fails nothing), and the consumer is reopened from
        the positions stored with the rows: exactly what a restarted projector would read."""
        if self._kafka_down is not None or self._consumer is None:
            return
        if not self._fetch_stall.look_due():
            return
        behind = self._records_waiting()
        if not behind:
            return
        log.warning(
            "projector fetched nothing for %.0fs while records wait on the broker (%s); "
            "reopening its consumer from the stored positions",
            self._fetch_stall.bound_s,
            listed(behind),
        )
        self._metrics.projector_consumer_reopens.inc()
        self._fetch_stall.remedied()
        self._reopen()

    def _reopen(self) -> None:
        """A new consumer (and dead-letter producer) from the positions stored with the rows."""
        self._close_clients()
        self._waiting.clear()
        self._execution_ends.clear()
        self._positions.clear()
        self._consumer = self._open_patiently()

    def _records_waiting(self) -> list[str]:
        """Partitions the broker holds records for beyond what this projector has read; a
        delivery partition held on purpose counts only once what it waits for cannot come."""
        assert self._consumer is not None
        asked: dict[tuple[str, int], int] = {}
        for (topic, partition), position in self._positions.items():
            needed = self._waiting.get((topic, partition))
            if needed is not None:
                execution = self._positions.get((self._config.execution_topic, partition), 0)
                # Held until its execution partition is read that far, which it still can be
                # while that partition has records to read; otherwise it is held for nothing.
                if needed > execution and records_waiting(
                    self._consumer, {(self._config.execution_topic, partition): execution}
                ):
                    continue
            asked[(topic, partition)] = position
        return records_waiting(self._consumer, asked)

    def _wait_backoff(self) -> None:
        self._backoff_s = min(max(self._backoff_s * 2, 0.1), self._max_backoff_s)
        self._stopping.wait(self._backoff_s)

    def _try_reconnect(self) -> None:
        reconnect = getattr(self._sink, "reconnect", None)
        if reconnect is None:
            return
        try:
            reconnect()
        except SinkUnavailableError as exc:
            log.warning("still cannot reach the projection database: %s", exc)

    # -- dead letters ---------------------------------------------------------------------------

    def _publish_dead_letters(self, dead: list[DeadLetter]) -> list[DeadLetter]:
        """Send dead letters to the dead-letter topic and wait for the broker's ack; returns them
        as stored (an oversized one becomes a reference).

        This happens before the projection commit: a crash in between re-sends them on
        redelivery (the dead-letter topic is at-least-once; its headers carry the source
        coordinates, which identify repeats), but a poison record is never lost.
        """
        assert self._dlq is not None
        fresh = [letter for letter in dead if letter.coordinates not in self._published]
        sent = iter(send_dead_letters(self._dlq, self._config.dead_letter_topic, fresh))
        stored = [
            letter if letter.coordinates in self._published else next(sent) for letter in dead
        ]
        for item in stored:
            c = item.coordinates
            if c not in self._published:
                self._published.add(c)
                self._metrics.dead_letters.labels(c.topic).inc()
                log.warning(
                    "dead-lettered %s[%d]@%d%s: %s",
                    c.topic,
                    c.partition,
                    c.offset,
                    " (by reference)" if item.by_reference else "",
                    item.reason,
                )
        return stored

    # -- metrics ----------------------------------------------------------------------------------

    def _report_open_ages(self, every_s: float = 5.0) -> None:
        """Refresh the oldest-unfinished-work gauges from the projections."""
        now = time.monotonic()
        if now - self._ages_reported_at < every_s:
            return
        self._ages_reported_at = now
        try:
            ages = self._sink.open_ages()
        except Exception as exc:  # a gauge refresh must never stop the projector
            log.debug("open ages not refreshed: %s", exc)
            return
        executions = self._metrics.execution_oldest_age_seconds
        deliveries = self._metrics.delivery_oldest_age_seconds
        # Cleared first: a state that emptied must disappear, not keep its last age.
        executions.clear()
        deliveries.clear()
        for state, age in ages.executions.items():
            executions.labels(state).set(age)
        for (destination, state), age in ages.deliveries.items():
            deliveries.labels(destination, state).set(age)

    def _report_lag(self, every_s: float = 1.0) -> None:
        """Set the lag gauge from librdkafka's cached high watermarks (no broker round trip).

        A projector that is alive but not keeping up shows here, not in a heartbeat.
        """
        now = time.monotonic()
        if self._consumer is None or now - self._lag_reported_at < every_s:
            return
        self._lag_reported_at = now
        lag: dict[str, int] = dict.fromkeys(self._config.topics, 0)
        for (topic, partition), position in self._positions.items():
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, partition), cached=True
            )
            if high >= 0:
                lag[topic] += max(0, high - max(position, low))
        for topic, records in lag.items():
            self._metrics.projector_lag_records.labels(topic).set(records)

    def _observe(self, report: ProjectionReport, batch: ProjectionBatch, seconds: float) -> None:
        m = self._metrics
        m.projector_batch_seconds.observe(seconds)
        m.projector_batch_events.observe(
            len(batch.events) + len(batch.dead_letters) + len(batch.policy_changes)
        )
        for machine in _MACHINES:
            m.projected_events.labels(machine, "applied").inc(report.applied[machine])
            m.projected_events.labels(machine, "duplicate").inc(report.duplicates[machine])
            m.projected_events.labels(machine, "anomaly").inc(report.anomalies[machine])
            m.duplicate_transitions.labels(machine).inc(report.duplicates[machine])
            m.illegal_transitions.labels(machine).inc(report.anomalies[machine])
        m.projector_skipped_redelivered.inc(report.skipped_redelivered)
        for (machine, kind), count in report.anomaly_kinds.items():
            m.anomalies.labels(machine, kind).inc(count)
        if report.redrives:
            m.delivery_redrives.inc(report.redrives)
        if report.policy_changes:
            m.projected_events.labels("policy", "applied").inc(report.policy_changes)
        if report.policy_stale:
            m.projected_events.labels("policy", "anomaly").inc(len(report.policy_stale))
            m.anomalies.labels("policy", "replayed_policy_change").inc(len(report.policy_stale))
            for reason in report.policy_stale:
                log.warning("policy change not applied: %s", reason)
        # One observation per event, as the metric is documented; the bound method and the
        # inline clamp keep it to the histogram's own cost.
        now = self._clock()
        observe = m.append_to_visible_seconds.observe
        for item in batch.events:
            lag = now - item.timestamp_ms / 1000
            observe(lag if lag > 0.0 else 0.0)
        if report.anomalies["execution"] or report.anomalies["delivery"]:
            log.warning("batch stored %s anomalies", report.anomalies)


def _behind_rewind(read: _Read, rewound: dict[tuple[str, int], int]) -> bool:
    c = read.coordinates
    offset = rewound.get((c.topic, c.partition))
    return offset is not None and c.offset >= offset


def _merge(total: ProjectionReport, report: ProjectionReport) -> None:
    for machine in _MACHINES:
        total.applied[machine] += report.applied[machine]
        total.duplicates[machine] += report.duplicates[machine]
        total.anomalies[machine] += report.anomalies[machine]
    total.dead_letters += report.dead_letters
    total.skipped_redelivered += report.skipped_redelivered
    total.policy_changes += report.policy_changes
    total.policy_stale += report.policy_stale
    total.rewind.update(report.rewind)

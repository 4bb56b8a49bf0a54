"""The projector's read path: a confluent-kafka consumer polled in batches, beneath faust.

Why not a faust agent: on this 2-core machine a faust agent that only counts our events reads
about 12-13k events/s (its per-event path, ``take`` or plain iteration alike), below the
projector's 20k/s target, while a batch ``consume()`` loop reads about 1M/s and about 93k/s
with every record decoded (``bench/bench_read_path.py``). faust still hosts this loop as a
service (worker lifecycle, signals, web /metrics); the loop just reads beneath the per-event
stream.

Partitions are assigned, not subscribed: positions live in PostgreSQL with the rows they produced,
so there is no group rebalance to wait for after a SIGKILL, and a restarted projector resumes at
exactly the committed position. Kafka's group offsets are committed afterwards for lag tooling only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)

from ledger.codec import Codec, DecodeError
from ledger.faults import fault_point
from ledger.metrics import Metrics
from ledger.records import (
    Coordinates,
    DeadLetter,
    ProjectionBatch,
    ProjectionReport,
    ProjectionSink,
    SourcedEvent,
)
from ledger.settings import Settings

log = logging.getLogger("opledger.projector")

_MACHINES = ("execution", "delivery")


class ProjectorError(RuntimeError):
    """The projector cannot go on (broker unreachable, topics missing)."""


@dataclass(frozen=True, slots=True)
class ReaderConfig:
    consumer_name: str
    topics: tuple[str, ...]
    dead_letter_topic: str
    batch_size: int
    poll_timeout_s: float = 0.05


def reader_config(settings: Settings) -> ReaderConfig:
    return ReaderConfig(
        consumer_name=settings.projector_group,
        topics=(settings.execution_topic, settings.delivery_topic),
        dead_letter_topic=settings.dead_letter_topic,
        batch_size=settings.projector_batch,
    )


def classify(
    codec: Codec,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    timestamp_ms: int,
) -> SourcedEvent | DeadLetter:
    """Decode one raw record at the edge; anything unusable becomes a dead letter with a reason."""
    coords = Coordinates(topic, partition, offset)
    if value is None:
        return DeadLetter(coords, "empty record value", key, value, timestamp_ms)
    try:
        event = codec.decode(value)
    except DecodeError as exc:
        return DeadLetter(coords, str(exc), key, value, timestamp_ms)
    expected_machine = "execution" if ".execution." in topic else "delivery"
    if event.kind != expected_machine:
        return DeadLetter(
            coords, f"{event.kind} event on the {expected_machine} topic", key, value, timestamp_ms
        )
    # One operation's history must live on one partition; a record keyed otherwise could be
    # folded out of order by another partition's batch, so it is refused rather than guessed at.
    if key != event.operation_id.encode():
        return DeadLetter(
            coords, "record key is not the event's operation_id", key, value, timestamp_ms
        )
    return SourcedEvent(coords, event, timestamp_ms)


class BatchProjector:
    """Reads both topics in batches and hands each batch to a :class:`ProjectionSink`."""

    def __init__(
        self,
        settings: Settings,
        sink: ProjectionSink,
        codec: Codec,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._config = reader_config(settings)
        self._sink = sink
        self._codec = codec
        self._metrics = metrics
        self._clock = clock
        self._consumer: Consumer | None = None
        self._dlq: Producer | None = None
        self._stopping = False
        self._positions: dict[tuple[str, int], int] = {}
        self._lag_reported_at = 0.0
        self._ages_reported_at = 0.0
        self.batches = 0

    def stop(self) -> None:
        self._stopping = True

    def _open(self) -> Consumer:
        base: dict[str, Any] = {"bootstrap.servers": self._settings.bootstrap_servers}
        consumer = Consumer(
            {
                **base,
                "group.id": self._config.consumer_name,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "enable.partition.eof": False,
                "fetch.wait.max.ms": 20,
                "queued.max.messages.kbytes": 65536,
            }
        )
        self._dlq = Producer(
            {
                **base,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "partitioner": "murmur2_random",
            }
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

    def run(self, max_batches: int | None = None) -> None:
        """Poll, fold and commit until :meth:`stop` (or ``max_batches``, for tests)."""
        self._consumer = self._open()
        try:
            while not self._stopping and (max_batches is None or self.batches < max_batches):
                self.run_once()
        finally:
            self.close()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._dlq is not None:
            self._dlq.flush(10)
            self._dlq = None

    def run_once(self) -> ProjectionReport | None:
        assert self._consumer is not None, "run() opens the consumer"
        messages = self._consumer.consume(self._config.batch_size, self._config.poll_timeout_s)
        self._report_lag()
        self._report_open_ages()
        if not messages:
            return None
        started = time.perf_counter()
        events: list[SourcedEvent] = []
        dead: list[DeadLetter] = []
        next_offsets: dict[tuple[str, int], int] = {}
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                raise ProjectorError(f"consume failed: {error}")
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None:
                raise ProjectorError("consumed a record without coordinates")
            _, timestamp_ms = message.timestamp()
            item = classify(
                self._codec,
                topic=topic,
                partition=partition,
                offset=offset,
                key=message.key(),
                value=message.value(),
                timestamp_ms=timestamp_ms,
            )
            if isinstance(item, SourcedEvent):
                events.append(item)
            else:
                dead.append(item)
            next_offsets[(topic, partition)] = offset + 1
        if dead:
            self._publish_dead_letters(dead)
        batch = ProjectionBatch(events, dead, next_offsets)
        fault_point("projector.before_commit")
        report = self._sink.project(self._config.consumer_name, batch)
        fault_point("projector.after_commit")
        self._consumer.commit(
            offsets=[TopicPartition(t, p, n) for (t, p), n in next_offsets.items()],
            asynchronous=True,
        )
        self.batches += 1
        self._positions.update(next_offsets)
        self._observe(report, batch, time.perf_counter() - started)
        return report

    def _report_open_ages(self, every_s: float = 5.0) -> None:
        """Refresh the oldest-unfinished-work gauges from the projections."""
        now = time.monotonic()
        if now - self._ages_reported_at < every_s:
            return
        self._ages_reported_at = now
        ages = self._sink.open_ages()
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

    def _publish_dead_letters(self, dead: list[DeadLetter]) -> None:
        """Send undecodable records to the dead-letter topic and wait for the broker's ack.

        This happens before the projection commit: a crash in between re-sends them on
        redelivery (the dead-letter topic is at-least-once; its headers carry the source
        coordinates, which identify repeats), but a poison record is never lost.
        """
        assert self._dlq is not None
        failures: list[str] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        for item in dead:
            c = item.coordinates
            self._dlq.produce(
                self._config.dead_letter_topic,
                key=item.key,
                value=item.value,
                headers=[
                    ("opledger-dlq-reason", item.reason.encode()),
                    ("opledger-source-topic", c.topic.encode()),
                    ("opledger-source-partition", str(c.partition).encode()),
                    ("opledger-source-offset", str(c.offset).encode()),
                    ("opledger-source-timestamp-ms", str(item.timestamp_ms).encode()),
                ],
                on_delivery=on_delivery,
            )
            self._metrics.dead_letters.labels(c.topic).inc()
            log.warning("dead-lettered %s[%d]@%d: %s", c.topic, c.partition, c.offset, item.reason)
        remaining = self._dlq.flush(30)
        if remaining or failures:
            raise KafkaException(f"dead-letter publish failed: {failures or remaining}")

    def _observe(self, report: ProjectionReport, batch: ProjectionBatch, seconds: float) -> None:
        m = self._metrics
        m.projector_batch_seconds.observe(seconds)
        m.projector_batch_events.observe(len(batch.events) + len(batch.dead_letters))
        for machine in _MACHINES:
            m.projected_events.labels(machine, "applied").inc(report.applied[machine])
            m.projected_events.labels(machine, "duplicate").inc(report.duplicates[machine])
            m.projected_events.labels(machine, "anomaly").inc(report.anomalies[machine])
            m.duplicate_transitions.labels(machine).inc(report.duplicates[machine])
            m.illegal_transitions.labels(machine).inc(report.anomalies[machine])
        m.projector_skipped_redelivered.inc(report.skipped_redelivered)
        # One observation per event, as the metric is documented; the bound method and the
        # inline clamp keep it to the histogram's own cost.
        now = self._clock()
        observe = m.append_to_visible_seconds.observe
        for item in batch.events:
            lag = now - item.timestamp_ms / 1000
            observe(lag if lag > 0.0 else 0.0)
        if report.anomalies["execution"] or report.anomalies["delivery"]:
            log.warning("batch stored %s anomalies", report.anomalies)

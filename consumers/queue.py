"""The Kafka-side consumer for queue destinations: the same deduplication as the receiver.

A queue destination's records carry the ``POST /events`` body as value, the operation id as
key, and ``Idempotency-Key`` and ``webhook-id`` headers. They are not signed: the broker is the
trust boundary here (whoever may write the topic is trusted by its ACLs, as whoever may read it),
so what a signature proves over HTTP is proved by the broker's authentication.

Records are handled one by one in partition order; the Kafka offsets of a batch are committed
only after every record of it was committed to the inbox (or refused). A crash in between makes
Kafka redeliver records whose keys the inbox (or the view) already holds: they are counted as
duplicates and not applied again. A record that is not a valid event is logged with its
coordinates (never its value), counted, and skipped: nothing a topic holds stops the consumer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from consumers.contract import (
    IDEMPOTENCY_HEADER,
    MAX_BODY_BYTES,
    WEBHOOK_ID_HEADER,
    Event,
    ProblemError,
    body_too_large,
    key_mismatch,
    malformed_body,
    parse_event,
    parse_idempotency_key,
)
from consumers.dedup import Decision
from consumers.inbox import Inbox, Recorded, Verdict
from consumers.runtime import ConsumerRuntime
from ledger.faults import fault_point
from ledger.kafka import consumer_config
from ledger.pg import DatabaseUnavailableError

log = logging.getLogger("opledger.consumer.queue")


def _headers(message: Any) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, value in message.headers() or ():
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else ""
        found.setdefault(name.lower(), []).append(text)
    return found


class QueueConsumer:
    """Consumes one queue topic into ``runtime``'s inbox, in consumer group ``group_id``.

    Blocking; the inbox runs on a private event loop of this consumer, one transaction per
    consumed batch (a key repeated inside one batch is decided in a later round, against the
    first copy)."""

    def __init__(
        self,
        runtime: ConsumerRuntime,
        topic: str,
        *,
        group_id: str | None = None,
        batch: int = 500,
    ) -> None:
        self.runtime = runtime
        self.topic = topic
        self.group_id = group_id or f"{runtime.settings.topic_prefix}-consumer-{runtime.name}"
        self._batch = batch
        self._stop = threading.Event()
        self._consumer: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: Inbox | None = None
        self._metric = runtime.metrics.queue_records

    def stop(self) -> None:
        self._stop.set()

    def open(self) -> None:
        """Start the runtime (restore included) if it is not ready, then subscribe."""
        if not self.runtime.ready:
            self.runtime.start()
        self._loop = asyncio.new_event_loop()
        self._inbox = self._loop.run_until_complete(self.runtime.open_inbox(1))
        config = consumer_config(
            self.runtime.settings,
            group_id=self.group_id,
            client_id=f"opledger-consumer-queue-{self.runtime.name}",
        )
        # A crashed member holds its partitions until its session times out (librdkafka: 45 s);
        # its redelivered records are deduplicated anyway, so hand them over sooner.
        config["session.timeout.ms"] = 10_000
        self._consumer = Consumer(config)
        self._consumer.subscribe([self.topic])

    def close(self) -> None:
        """Leave the group (the runtime stays open: its owner closes it)."""
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._loop is not None:
            if self._inbox is not None:
                self._loop.run_until_complete(self._inbox.close())
                self._inbox = None
            self._loop.close()
            self._loop = None

    def run(self) -> None:
        """Consume until :meth:`stop`."""
        self.open()
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self.close()

    def run_once(self, timeout_s: float = 0.5) -> int:
        """Handle one batch and commit its offsets; returns how many records it held."""
        messages = self._consumer.consume(self._batch, timeout_s)
        positions: dict[tuple[str, int], int] = {}
        events: list[Event] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("queue %s: %s", self.topic, error.str())
                continue
            positions[(message.topic(), message.partition())] = message.offset() + 1
            event = self._event(message)
            if event is not None:
                events.append(event)
        if events and not self._decide(events):
            return len(messages)  # stopped while the database was down: commit nothing
        if positions:
            fault_point("consumer.queue_after_commit_before_offsets")
            self._consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in positions.items()],
                asynchronous=False,
            )
        return len(messages)

    def _decide(self, events: list[Event]) -> bool:
        """Dedup and record ``events`` (in rounds of distinct keys); False if stopped first."""
        dedup = self.runtime.dedup
        pending = events
        while pending:
            wave: list[Event] = []
            later: list[Event] = []
            seen: set[str] = set()
            for event in pending:
                (later if event.operation_id in seen else wave).append(event)
                seen.add(event.operation_id)
            known = {e.operation_id: dedup.known(e) for e in wave}
            unknown = [e for e in wave if known[e.operation_id] is None]
            recorded = self._record(unknown) if unknown else {}
            if recorded is None:
                return False
            for event in wave:
                decision = known[event.operation_id]
                result = recorded.get(event.operation_id)
                if decision is None:
                    assert result is not None
                    seen_in = "new" if result.verdict is Verdict.ACCEPTED else "inbox"
                    decision = Decision(result.verdict, seen_in)
                dedup.settle(event, decision, result, "queue")
                self._metric.labels(self.runtime.name, decision.verdict.value).inc()
                if decision.verdict is Verdict.CONFLICT:
                    log.warning(
                        "queue: %s was accepted earlier with another body; not applied",
                        event.operation_id,
                    )
            pending = later
        return True

    def _record(self, events: list[Event]) -> dict[str, Recorded] | None:
        assert self._loop is not None and self._inbox is not None
        delay = 0.1
        while True:
            try:
                results = self._loop.run_until_complete(self._inbox.record_many(events, "queue"))
                return {e.operation_id: r for e, r in zip(events, results, strict=True)}
            except DatabaseUnavailableError as exc:
                # Nothing is committed (offsets included): keep trying this batch.
                log.warning("queue batch waits for the database: %s", exc)
                if self._stop.wait(delay):
                    return None
                delay = min(delay * 2, 5.0)

    def _event(self, message: Any) -> Event | None:
        try:
            return _parse(message)
        except ProblemError as exc:
            self._metric.labels(self.runtime.name, exc.problem.slug).inc()
            log.warning(
                "queue record %s[%d]@%d refused and skipped: %s",
                message.topic(),
                message.partition(),
                message.offset(),
                exc.problem.detail,
            )
            return None


def _parse(message: Any) -> Event:
    headers = _headers(message)
    key = parse_idempotency_key(headers.get(IDEMPOTENCY_HEADER.lower(), []))
    if message.key() != key.encode():
        raise key_mismatch("the record key is not the Idempotency-Key")
    value = message.value()
    if value is None:
        raise malformed_body("the record has no value")
    if len(value) > MAX_BODY_BYTES:
        raise body_too_large(MAX_BODY_BYTES)
    webhook_ids = headers.get(WEBHOOK_ID_HEADER, [])
    if len(webhook_ids) != 1:
        raise key_mismatch(f"a queue record carries exactly one {WEBHOOK_ID_HEADER} header")
    return parse_event(value, key, webhook_ids[0])


def drain(consumer: QueueConsumer, idle_s: float = 2.0, timeout_s: float = 60.0) -> int:
    """Run an opened ``consumer`` until no record arrived for ``idle_s`` (or ``timeout_s``
    passed); returns how many records it saw. For tests and one-shot runs."""
    seen = 0
    quiet_since = time.monotonic()
    deadline = quiet_since + timeout_s
    while time.monotonic() < deadline:
        n = consumer.run_once()
        seen += n
        now = time.monotonic()
        if n:
            quiet_since = now
        elif now - quiet_since >= idle_s:
            break
    return seen

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

A result too large for a record comes by reference (decision 016): the consumer fetches it with
a ``GET`` signed with the queue destination's fetch secret, before recording, exactly as the
receiver does. The record was acknowledged to the ledger when it was appended, so nobody will
send it again: when a fetch cannot be made now, nothing of its batch is recorded or committed,
the consumer seeks back to the batch's first records and reads them again after a backoff,
until the fetch is made. A database that does not answer is waited out the same way (each
attempt is short, so a long outage does not cost the consumer its group membership). Bytes
that are not the result are refused and skipped like any invalid record: fetching them again
would give the same bytes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from consumers.contract import (
    IDEMPOTENCY_HEADER,
    MAX_BODY_BYTES,
    WEBHOOK_ID_HEADER,
    Event,
    ProblemError,
    body_too_large,
    invalid_event,
    key_mismatch,
    malformed_body,
    parse_event,
    parse_idempotency_key,
)
from consumers.dedup import Decision
from consumers.fetch import ResultFetcher
from consumers.inbox import Inbox, Recorded, Verdict
from consumers.runtime import ConsumerRuntime
from ledger.faults import fault_point
from ledger.kafka import consumer_config
from ledger.pg import DatabaseUnavailableError

log = logging.getLogger("opledger.consumer.queue")

#: The wait before a batch that could not be finished is read again, doubling up to the
#: maximum. Each attempt is short (a fetch's or a connection's timeout plus this), far inside
#: max.poll.interval.ms: an outage of any length does not cost the consumer its group.
FIRST_RETRY_DELAY_S = 0.1
MAX_RETRY_DELAY_S = 5.0


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
        fetch_secrets: Sequence[str] = (),
        kafka_config: Mapping[str, Any] | None = None,
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
        self._fetches = runtime.metrics.result_fetches
        #: None without a fetch secret: results by reference are then refused (and logged)
        self._fetcher = ResultFetcher(fetch_secrets) if fetch_secrets else None
        self._retry_delay = FIRST_RETRY_DELAY_S
        #: librdkafka settings over the defaults below (``max.poll.interval.ms``, say)
        self._kafka_config = dict(kafka_config or {})

    def stop(self) -> None:
        self._stop.set()

    def open(self) -> None:
        """Start the runtime (restore included) if it is not ready, then subscribe."""
        if not self.runtime.ready:
            self.runtime.start()
        self._loop = asyncio.new_event_loop()
        self._inbox = self._loop.run_until_complete(self.runtime.open_inbox(1))
        if self._fetcher is not None:
            self._loop.run_until_complete(self._fetcher.start())
        config = consumer_config(
            self.runtime.settings,
            group_id=self.group_id,
            client_id=f"opledger-consumer-queue-{self.runtime.name}",
        )
        # A crashed member holds its partitions until its session times out (librdkafka: 45 s);
        # its redelivered records are deduplicated anyway, so hand them over sooner.
        config["session.timeout.ms"] = 10_000
        config.update(self._kafka_config)
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
            if self._fetcher is not None:
                self._loop.run_until_complete(self._fetcher.close())
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
        invalid: list[tuple[Any, ProblemError]] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("queue %s: %s", self.topic, error.str())
                continue
            positions[(message.topic(), message.partition())] = message.offset() + 1
            try:
                events.append(_parse(message))
            except ProblemError as exc:
                invalid.append((message, exc))
        if events and not self._handle(events):
            # The database did not answer or a result could not be fetched: commit nothing,
            # read the batch again after a backoff (what was recorded is then a duplicate).
            self._rewind(messages)
            self._stop.wait(self._retry_delay)
            self._retry_delay = min(self._retry_delay * 2, MAX_RETRY_DELAY_S)
            return len(messages)
        self._retry_delay = FIRST_RETRY_DELAY_S
        for message, problem in invalid:  # once, when the batch goes on without them
            self._skip(message, problem)
        if positions:
            fault_point("consumer.queue_after_commit_before_offsets")
            try:
                self._consumer.commit(
                    offsets=[TopicPartition(t, p, o) for (t, p), o in positions.items()],
                    asynchronous=False,
                )
            except KafkaException as exc:
                # The group moved on (a rebalance): the partitions' new owner reads these
                # records again and finds their keys already taken.
                log.warning("queue: offsets not committed: %s", exc.args[0])
        return len(messages)

    def _handle(self, events: list[Event]) -> bool:
        """Fetch, dedup and record ``events``; False if that could not be finished now."""
        with_results = self._with_results(events)
        return with_results is not None and self._decide(with_results)

    def _decide(self, events: list[Event]) -> bool:
        """Dedup and record ``events`` (in rounds of distinct keys); False if the database did
        not answer (the rounds before are recorded)."""
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

    def _with_results(self, events: list[Event]) -> list[Event] | None:
        """``events`` with each result by reference fetched, less those whose fetched bytes
        were refused (counted and logged); None if one could not be fetched now. Keys the view
        already holds are decided without fetching, as the receiver does."""
        assert self._loop is not None
        wanted = {
            (e.operation_id, e.fingerprint): e
            for e in events
            if e.result is None and self.runtime.dedup.known(e) is None
        }
        if not wanted:
            return events
        got: dict[tuple[str, bytes], Event] = {}
        if self._fetcher is None:
            missing = invalid_event("no fetch secret is configured for this consumer")
            answers: list[Event | BaseException] = [missing] * len(wanted)
        else:
            answers = self._loop.run_until_complete(_fetch_all(self._fetcher, [*wanted.values()]))
        unavailable = 0
        refused: list[tuple[Event, ProblemError]] = []
        for key, answer in zip(wanted, answers, strict=True):
            if isinstance(answer, Event):
                self._fetches.labels(self.runtime.name, "fetched").inc()
                got[key] = answer
            elif isinstance(answer, ProblemError) and answer.problem.status == 422:
                refused.append((wanted[key], answer))
            elif isinstance(answer, Exception):
                self._fetches.labels(self.runtime.name, "unavailable").inc()
                detail = answer.problem.detail if isinstance(answer, ProblemError) else ""
                log.warning(
                    "queue: %s's result not fetched yet (its batch is read again): %s",
                    key[0],
                    detail or type(answer).__name__,
                )
                unavailable += 1
            else:
                raise answer
        if unavailable:
            return None
        for event, problem in refused:  # counted once, when the batch goes on without them
            self._refused(event, problem)
        return [
            got.get((e.operation_id, e.fingerprint), e)
            for e in events
            if (e.operation_id, e.fingerprint) not in wanted
            or (e.operation_id, e.fingerprint) in got
        ]

    def _rewind(self, messages: list[Any]) -> None:
        """Seek each partition of ``messages`` back to its first record in them."""
        first: dict[tuple[str, int], int] = {}
        for message in messages:
            if message.error() is None:
                first.setdefault((message.topic(), message.partition()), message.offset())
        for (topic, partition), offset in first.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:
                # No longer ours: its new owner reads it from the last committed offset.
                log.info("queue: not rewound %s[%d]: %s", topic, partition, exc)

    def _refused(self, event: Event, problem: ProblemError) -> None:
        self._fetches.labels(self.runtime.name, "refused").inc()
        self._metric.labels(self.runtime.name, problem.problem.slug).inc()
        log.warning(
            "queue: %s's result by reference refused and skipped: %s",
            event.operation_id,
            problem.problem.detail,
        )

    def _record(self, events: list[Event]) -> dict[str, Recorded] | None:
        assert self._loop is not None and self._inbox is not None
        try:
            results = self._loop.run_until_complete(self._inbox.record_many(events, "queue"))
        except DatabaseUnavailableError as exc:
            log.warning("queue: the batch waits for the database: %s", exc)
            return None
        return {e.operation_id: r for e, r in zip(events, results, strict=True)}

    def _skip(self, message: Any, problem: ProblemError) -> None:
        self._metric.labels(self.runtime.name, problem.problem.slug).inc()
        log.warning(
            "queue record %s[%d]@%d refused and skipped: %s",
            message.topic(),
            message.partition(),
            message.offset(),
            problem.problem.detail,
        )


async def _fetch_all(fetcher: ResultFetcher, events: list[Event]) -> list[Event | BaseException]:
    return await asyncio.gather(*(fetcher.fetch(e) for e in events), return_exceptions=True)


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
    return parse_event(value, key, webhook_ids[0], by_reference=True)


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

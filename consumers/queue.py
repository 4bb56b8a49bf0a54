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
send it again: when a fetch cannot be made now, nothing of that record's partition in the batch
is recorded or committed; the consumer seeks that partition back, pauses it, and reads it again
after a backoff of its own, until the fetch is made. The other partitions go on meanwhile: one
result that cannot be fetched holds back only the records queued behind it. A database that does
not answer is waited out by the whole batch the same way (each attempt is short, so a long outage
does not cost the consumer its group membership). Bytes that are not the result are refused and
skipped like any invalid record: fetching them again would give the same bytes. A pass fetches
at most :data:`MAX_FETCHED_BYTES_PER_PASS` of results (they are held in memory until its batch
is recorded); the records past that budget are read again by the next pass.
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
#: Bytes of results by reference one pass fetches at most (at least one result, whatever its
#: size): every fetched result of a batch is held in memory until the batch is recorded, and
#: a batch of 500 records could otherwise name 500 results of up to 16 MiB each. The records
#: past it are read again by the next pass, at once.
MAX_FETCHED_BYTES_PER_PASS = 64 * 1024 * 1024

#: A topic partition, as (topic, partition).
Partition = tuple[str, int]


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
        results_url: str | None = None,
        max_fetched_bytes: int = MAX_FETCHED_BYTES_PER_PASS,
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
        #: None without a fetch secret: results by reference are then refused (and logged).
        #: Records are not signed: only references under the ledger's results URL (default:
        #: the settings' OPLEDGER_DELIVERY_RESULTS_URL) are fetched, so a record cannot send
        #: a signed fetch to a host of its writer's choosing.
        self._fetcher = (
            ResultFetcher(fetch_secrets, base_url=results_url or runtime.settings.results_base_url)
            if fetch_secrets
            else None
        )
        self._max_fetched_bytes = max_fetched_bytes
        self._retry_delay = FIRST_RETRY_DELAY_S
        #: partitions paused while a result of theirs cannot be fetched: when each resumes...
        self._held: dict[Partition, float] = {}
        #: ...and the wait before it would be paused again, doubling until a batch of it passes
        self._hold_delays: dict[Partition, float] = {}
        #: assigned by the last rebalance: resumed once, as librdkafka may keep a partition
        #: paused across a rebalance
        self._assigned: list[TopicPartition] = []
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
        self._consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )

    def _on_assign(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        # Called before librdkafka applies the assignment; resumed in the next run_once.
        self._assigned.extend(partitions)

    def _on_revoke(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        # A new owner reads them from the last committed offset: nothing of ours is held.
        for tp in partitions:
            self._held.pop((tp.topic, tp.partition), None)
            self._hold_delays.pop((tp.topic, tp.partition), None)

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
        self._resume_due()
        messages = self._consumer.consume(self._batch, timeout_s)
        first: dict[Partition, int] = {}
        positions: dict[Partition, int] = {}
        entries: list[tuple[Partition, int, Event]] = []
        invalid: list[tuple[Partition, Any, ProblemError]] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("queue %s: %s", self.topic, error.str())
                continue
            partition = (message.topic(), message.partition())
            first.setdefault(partition, message.offset())
            positions[partition] = message.offset() + 1
            try:
                entries.append((partition, message.offset(), _parse(message)))
            except ProblemError as exc:
                invalid.append((partition, message, exc))
        if later := self._past_the_fetch_budget(entries):
            # Read again by the next pass; only what came before them is handled and committed.
            self._rewind(later)
            entries = [(p, o, e) for p, o, e in entries if p not in later or o < later[p]]
            invalid = [i for i in invalid if i[0] not in later or i[1].offset() < later[i[0]]]
            positions.update(later)
        fetched, unfetched, refused = self._with_results([(p, e) for p, _o, e in entries])
        if unfetched:
            # Nothing of these partitions in this batch is recorded or committed.
            self._hold({p: first[p] for p in unfetched})
        events = [e for p, e in fetched if p not in unfetched]
        going_on = {p: o for p, o in first.items() if p not in unfetched}
        if events and not self._decide(events):
            # The database did not answer: commit nothing, read the batch again after a
            # backoff (what was recorded is then a duplicate).
            self._rewind(going_on)
            self._stop.wait(self._retry_delay)
            self._retry_delay = min(self._retry_delay * 2, MAX_RETRY_DELAY_S)
            return len(messages)
        self._retry_delay = FIRST_RETRY_DELAY_S
        # Counted once, when their partition goes on without them.
        for partition, event, problem in refused:
            if partition not in unfetched:
                self._refused(event, problem)
        for partition, message, problem in invalid:
            if partition not in unfetched:
                self._skip(message, problem)
        for partition in going_on:
            self._hold_delays.pop(partition, None)
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items() if (t, p) in going_on]
        if offsets:
            fault_point("consumer.queue_after_commit_before_offsets")
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                # The group moved on (a rebalance): the partitions' new owner reads these
                # records again and finds their keys already taken.
                log.warning("queue: offsets not committed: %s", exc.args[0])
        return len(messages)

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

    def _past_the_fetch_budget(
        self, entries: list[tuple[Partition, int, Event]]
    ) -> dict[Partition, int]:
        """Per partition, the offset of its first record whose result would take this pass's
        fetches over their byte budget (that record and the rest of its partition wait)."""
        spent = 0
        later: dict[Partition, int] = {}
        for partition, offset, event in entries:
            size = event.body.result_size
            if partition in later or event.result is not None or size is None:
                continue
            if self.runtime.dedup.known(event) is not None:
                continue  # decided without a fetch
            if spent and spent + size > self._max_fetched_bytes:
                later[partition] = offset
            else:
                spent += size
        return later

    def _with_results(
        self, entries: list[tuple[Partition, Event]]
    ) -> tuple[
        list[tuple[Partition, Event]], set[Partition], list[tuple[Partition, Event, ProblemError]]
    ]:
        """``entries`` with each result by reference fetched, less those whose fetched bytes
        were refused (returned apart, to be counted once their partition goes on); and the
        partitions holding a result that could not be fetched now. Keys the view already holds
        are decided without fetching, as the receiver does."""
        assert self._loop is not None
        wanted: dict[tuple[str, bytes], Event] = {}
        where: dict[tuple[str, bytes], set[Partition]] = {}
        for partition, e in entries:
            if e.result is None and self.runtime.dedup.known(e) is None:
                key = (e.operation_id, e.fingerprint)
                wanted.setdefault(key, e)
                where.setdefault(key, set()).add(partition)
        if not wanted:
            return entries, set(), []
        got: dict[tuple[str, bytes], Event] = {}
        if self._fetcher is None:
            missing = invalid_event("no fetch secret is configured for this consumer")
            answers: list[Event | BaseException] = [missing] * len(wanted)
        else:
            answers = self._loop.run_until_complete(_fetch_all(self._fetcher, [*wanted.values()]))
        unfetched: set[Partition] = set()
        refused_keys: dict[tuple[str, bytes], ProblemError] = {}
        for key, answer in zip(wanted, answers, strict=True):
            if isinstance(answer, Event):
                self._fetches.labels(self.runtime.name, "fetched").inc()
                got[key] = answer
            elif isinstance(answer, ProblemError) and answer.problem.status == 422:
                refused_keys[key] = answer
            elif isinstance(answer, Exception):
                self._fetches.labels(self.runtime.name, "unavailable").inc()
                detail = answer.problem.detail if isinstance(answer, ProblemError) else ""
                log.warning(
                    "queue: %s's result not fetched yet (its partition is read again): %s",
                    key[0],
                    detail or type(answer).__name__,
                )
                unfetched |= where[key]
            else:
                raise answer
        kept: list[tuple[Partition, Event]] = []
        refused: list[tuple[Partition, Event, ProblemError]] = []
        for partition, e in entries:
            key = (e.operation_id, e.fingerprint)
            if key not in wanted:
                kept.append((partition, e))
            elif key in got:
                kept.append((partition, got[key]))
            elif key in refused_keys:
                refused.append((partition, e, refused_keys[key]))
        return kept, unfetched, refused

    def _hold(self, first: dict[Partition, int]) -> None:
        """Seek each partition back to ``first`` and pause it for its own backoff."""
        self._rewind(first)
        now = time.monotonic()
        for partition in first:
            delay = self._hold_delays.get(partition, FIRST_RETRY_DELAY_S)
            self._held[partition] = now + delay
            self._hold_delays[partition] = min(delay * 2, MAX_RETRY_DELAY_S)
        try:
            self._consumer.pause([TopicPartition(t, p) for t, p in first])
        except KafkaException as exc:
            log.info("queue: not paused %s: %s", sorted(first), exc)

    def _resume_due(self) -> None:
        """Resume the partitions whose hold is over, and those a rebalance just assigned."""
        now = time.monotonic()
        due = [p for p, at in self._held.items() if at <= now]
        for partition in due:
            del self._held[partition]
        resume = [TopicPartition(t, p) for t, p in due] + self._assigned
        self._assigned = []
        if resume:
            try:
                self._consumer.resume(resume)
            except KafkaException as exc:
                # No longer ours: its new owner reads it from the last committed offset.
                log.info("queue: not resumed: %s", exc)

    def _rewind(self, first: dict[Partition, int]) -> None:
        """Seek each partition back to its offset in ``first``."""
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

"""The Kafka-side consumer for queue destinations: the same deduplication as the receiver.

A queue destination's records carry the ``POST /events`` body as value, the operation id as
key, and ``Idempotency-Key`` and ``webhook-id`` headers. They are not signed: the broker is the
trust boundary here (whoever may write the topic is trusted by its ACLs, as whoever may read it),
so what a signature proves over HTTP is proved by the broker's authentication.

Records are handled one by one in partition order; the Kafka offsets of a batch are committed
only after every record of it was committed to the inbox or dead-lettered. A crash in between
makes Kafka redeliver records whose keys the inbox (or the view) already holds: they are counted
as duplicates and not applied again.

Nothing a topic holds stops the consumer, and nothing it does not take is lost: a record that is
not a valid event, a result whose fetched bytes are not the result, and a key already taken with
another body are put whole on the consumers' dead-letter topic with the reason
(:mod:`consumers.dead_letters`, decision 017), counted, logged with their coordinates (never
their value), and passed. ``opledger consumer redrive`` puts them back.

A result too large for a record comes by reference (decision 016): the consumer fetches it with
a ``GET`` signed with the queue destination's fetch secret, before recording, exactly as the
receiver does. The record was acknowledged to the ledger when it was appended, so nobody will
send it again: when a fetch cannot be made now, nothing of that record's partition in the batch
is recorded or committed; the consumer seeks that partition back, pauses it, and reads it again
after a backoff of its own, until the fetch is made or the record has waited
``OPLEDGER_CONSUMER_HOLD_LIMIT_S`` (counted in the consumer's database from the first failed
fetch by any of its replicas, so restarts and rebalances do not start it again): then it is
dead-lettered like the others and its partition goes on (a reference the ledger answers 404
for ever, forged or misrouted, holds its partition that long, not for good). The other
partitions go on meanwhile: one result that cannot be fetched holds back only the records
queued behind it. A database or a dead-letter topic that does not
answer is waited out by the whole batch the same way (each attempt is short, so a long outage
does not cost the consumer its group membership). A pass fetches at most
:data:`MAX_FETCHED_BYTES_PER_PASS` of results (they are held in memory until its batch is
recorded); the records past that budget are read again by the next pass.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumers.contract import (
    IDEMPOTENCY_HEADER,
    MAX_BODY_BYTES,
    WEBHOOK_ID_HEADER,
    Event,
    ProblemError,
    body_too_large,
    invalid_event,
    key_mismatch,
    key_reused,
    malformed_body,
    parse_event,
    parse_idempotency_key,
    result_unavailable,
)
from consumers.dead_letters import PUBLISH_TIMEOUT_S as DEAD_LETTER_TIMEOUT_S
from consumers.dead_letters import QueueDeadLetters
from consumers.dedup import Decision
from consumers.fetch import ResultFetcher
from consumers.inbox import Inbox, Recorded, Verdict
from consumers.runtime import ConsumerRuntime
from ledger.dead_letters import DeadLetterUnavailableError
from ledger.faults import fault_point
from ledger.log import new_consumer
from ledger.pg import DatabaseError, DatabaseUnavailableError
from ledger.records import Coordinates, DeadLetter

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

#: A hold clock this much older than the hold limit belongs to a record fetched since by an
#: owner that did not know of its clock: deleted when a consumer starts.
FORGOTTEN_HOLD_S = 24 * 3600.0

#: A topic partition, as (topic, partition).
Partition = tuple[str, int]


class EveryTenant:
    """The scope of a queue consumer that takes every tenant's records: a topic read on behalf
    of all the tenants that may name it. Said on purpose (``tenants=EVERY_TENANT``, ``opledger
    consumer queue --every-tenant``): a consumer with no scope would take what another tenant's
    destination wrote to its topic."""

    def __repr__(self) -> str:
        return "EVERY_TENANT"


EVERY_TENANT = EveryTenant()


def tenant_scope(tenants: Collection[str] | EveryTenant) -> frozenset[str] | None:
    """The tenants a consumer takes, or None for every tenant; an empty collection (a scope
    that takes nothing) and a bare string (a collection of its letters) are refused."""
    if isinstance(tenants, EveryTenant):
        return None
    if isinstance(tenants, str):
        raise TypeError(f"tenants is a collection of tenant ids, not one string: [{tenants!r}]")
    scope = frozenset(tenants)
    if not scope:
        raise ValueError(
            "a queue consumer takes at least one tenant's records: name them, or pass "
            "EVERY_TENANT for a consumer that receives for every tenant"
        )
    return scope


def _headers(message: Any) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, value in message.headers() or ():
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else ""
        found.setdefault(name.lower(), []).append(text)
    return found


@dataclass(frozen=True, slots=True)
class _TakenOut:
    """A record the consumer does not take, and why: it is dead-lettered, then passed."""

    partition: Partition
    message: Any
    problem: ProblemError
    #: invalid, foreign-tenant (not a tenant this consumer takes), refused (the bytes are not the
    #: result), conflict, unfetchable (hold limit)
    kind: str

    @property
    def offset(self) -> int:
        return int(self.message.offset())

    def letter(self) -> DeadLetter:
        message = self.message
        _kind, timestamp_ms = message.timestamp()
        return DeadLetter(
            Coordinates(message.topic(), message.partition(), message.offset()),
            f"{self.problem.problem.slug}: {self.problem.problem.detail}",
            message.key(),
            message.value(),
            timestamp_ms,
            headers=tuple(message.headers() or ()),
        )


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
        hold_limit_s: float | None = None,
        dead_letter_timeout_s: float = DEAD_LETTER_TIMEOUT_S,
        tenants: Collection[str] | EveryTenant,
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
        #: how long a record's result may stay unfetchable before it is dead-lettered
        self.hold_limit_s = (
            runtime.settings.consumer_hold_limit_s if hold_limit_s is None else hold_limit_s
        )
        #: records (partition, offset) whose hold clock this instance started or read...
        self._clocked: set[tuple[Partition, int]] = set()
        #: ...and those of them fetched or dead-lettered: released once committed past
        self._releasable: list[tuple[Partition, int]] = []
        self._dead_letters: QueueDeadLetters | None = None
        self._dead_letter_timeout_s = dead_letter_timeout_s
        #: the tenants whose records this consumer takes (None: every tenant). The delivery
        #: workers append every tenant's queue records with their own broker rights, so the
        #: topic's ACLs cannot keep another tenant's destination from naming this topic.
        self._tenants = tenant_scope(tenants)
        self._dead_lettered = runtime.metrics.dead_letters
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
        self._dead_letters = QueueDeadLetters(
            self.runtime.settings, self.runtime.name, timeout_s=self._dead_letter_timeout_s
        )
        try:
            self._loop.run_until_complete(
                self._inbox.forget_holds_older_than(self.hold_limit_s + FORGOTTEN_HOLD_S)
            )
        except (DatabaseUnavailableError, DatabaseError) as exc:
            log.info("queue: old hold clocks not deleted: %s", exc)
        if self._fetcher is not None:
            self._loop.run_until_complete(self._fetcher.start())
        self._consumer = new_consumer(
            self.runtime.settings,
            group_id=self.group_id,
            client_id=f"opledger-consumer-queue-{self.runtime.name}",
            # A crashed member holds its partitions until its session times out (librdkafka:
            # 45 s); its redelivered records are deduplicated anyway, so hand them over sooner.
            overrides={"session.timeout.ms": 10_000, **self._kafka_config},
        )
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
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        for partition in revoked:
            self._held.pop(partition, None)
            self._hold_delays.pop(partition, None)
        # Their clocks stay in the database for the partitions' next owner.
        self._clocked = {r for r in self._clocked if r[0] not in revoked}
        self._releasable = [r for r in self._releasable if r[0] not in revoked]

    def close(self) -> None:
        """Leave the group (the runtime stays open: its owner closes it)."""
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._dead_letters is not None:
            self._dead_letters.close()
            self._dead_letters = None
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
        entries: list[tuple[Partition, Any, Event]] = []
        taken_out: list[_TakenOut] = []
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
                event = _parse(message)
            except ProblemError as exc:
                taken_out.append(_TakenOut(partition, message, exc, "invalid"))
                continue
            if self._tenants is not None and event.body.tenant_id not in self._tenants:
                # Before any fetch: another tenant's result is not fetched either.
                problem = invalid_event("the record's tenant is not one this consumer takes")
                taken_out.append(_TakenOut(partition, message, problem, "foreign-tenant"))
                continue
            entries.append((partition, message, event))
        if later := self._past_the_fetch_budget(entries):
            # Read again by the next pass; only what came before them is handled and committed.
            self._rewind(later)
            entries = [(p, m, e) for p, m, e in entries if p not in later or m.offset() < later[p]]
            taken_out = [
                t for t in taken_out if t.partition not in later or t.offset < later[t.partition]
            ]
            positions.update(later)
        fetched, unfetched, refused = self._with_results(entries)
        taken_out += refused
        if unfetched:
            # Nothing of these partitions in this batch is recorded or committed.
            self._hold({p: first[p] for p in unfetched})
        going_on = {p: o for p, o in first.items() if p not in unfetched}
        conflicts = self._decide([(p, m, e) for p, m, e in fetched if p not in unfetched])
        if conflicts is None:
            # The database did not answer: commit nothing, read the batch again after a
            # backoff (what was recorded is then a duplicate).
            return self._again(going_on, len(messages))
        taken_out = [t for t in [*taken_out, *conflicts] if t.partition not in unfetched]
        if taken_out:
            assert self._dead_letters is not None
            try:
                self._dead_letters.publish([(t.letter(), t.kind) for t in taken_out])
            except DeadLetterUnavailableError as exc:
                log.warning("queue: the batch waits for the dead-letter topic: %s", exc)
                return self._again(going_on, len(messages))
        self._retry_delay = FIRST_RETRY_DELAY_S
        # Counted once, when their partition goes on without them.
        for item in taken_out:
            self._count_taken_out(item)
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
            self._release({p: o for p, o in positions.items() if p in going_on})
        return len(messages)

    def _again(self, going_on: dict[Partition, int], handled: int) -> int:
        """Read ``going_on`` again from its first offsets after a backoff; commit nothing."""
        self._rewind(going_on)
        self._stop.wait(self._retry_delay)
        self._retry_delay = min(self._retry_delay * 2, MAX_RETRY_DELAY_S)
        return handled

    def _decide(self, entries: list[tuple[Partition, Any, Event]]) -> list[_TakenOut] | None:
        """Dedup and record the events of ``entries`` (in rounds of distinct keys); returns
        those whose key was taken earlier with another body, or None if the database did not
        answer (the rounds before are recorded)."""
        dedup = self.runtime.dedup
        conflicts: list[_TakenOut] = []
        pending = entries
        while pending:
            wave: list[tuple[Partition, Any, Event]] = []
            later: list[tuple[Partition, Any, Event]] = []
            seen: set[str] = set()
            for entry in pending:
                operation_id = entry[2].operation_id
                (later if operation_id in seen else wave).append(entry)
                seen.add(operation_id)
            known = {e.operation_id: dedup.known(e) for _p, _m, e in wave}
            unknown = [e for _p, _m, e in wave if known[e.operation_id] is None]
            recorded = self._record(unknown) if unknown else {}
            if recorded is None:
                return None
            for partition, message, event in wave:
                decision = known[event.operation_id]
                result = recorded.get(event.operation_id)
                if decision is None:
                    assert result is not None
                    seen_in = "new" if result.verdict is Verdict.ACCEPTED else "inbox"
                    decision = Decision(result.verdict, seen_in)
                dedup.settle(event, decision, result, "queue")
                self._metric.labels(self.runtime.name, decision.verdict.value).inc()
                if decision.verdict is Verdict.CONFLICT:
                    problem = key_reused(event.operation_id)
                    conflicts.append(_TakenOut(partition, message, problem, "conflict"))
            pending = later
        return conflicts

    def _past_the_fetch_budget(
        self, entries: list[tuple[Partition, Any, Event]]
    ) -> dict[Partition, int]:
        """Per partition, the offset of its first record whose result would take this pass's
        fetches over their byte budget (that record and the rest of its partition wait)."""
        spent = 0
        later: dict[Partition, int] = {}
        for partition, message, event in entries:
            size = event.body.result_size
            if partition in later or event.result is not None or size is None:
                continue
            if self.runtime.dedup.known(event) is not None:
                continue  # decided without a fetch
            if spent and spent + size > self._max_fetched_bytes:
                later[partition] = message.offset()
            else:
                spent += size
        return later

    def _with_results(
        self, entries: list[tuple[Partition, Any, Event]]
    ) -> tuple[list[tuple[Partition, Any, Event]], set[Partition], list[_TakenOut]]:
        """``entries`` with each result by reference fetched, less those taken out (returned
        apart, to be dead-lettered once their partition goes on): bytes that are not the result,
        and results not fetched for :attr:`hold_limit_s`; and the partitions holding a result
        that could not be fetched now. Keys the view already holds are decided without fetching,
        as the receiver does."""
        assert self._loop is not None
        wanted: dict[tuple[str, bytes], Event] = {}
        for _partition, _message, e in entries:
            if e.result is None and self.runtime.dedup.known(e) is None:
                wanted.setdefault((e.operation_id, e.fingerprint), e)
        if not wanted:
            return entries, set(), []
        if self._fetcher is None:
            missing = invalid_event("no fetch secret is configured for this consumer")
            answers: list[Event | BaseException] = [missing] * len(wanted)
        else:
            answers = self._loop.run_until_complete(_fetch_all(self._fetcher, [*wanted.values()]))
        got: dict[tuple[str, bytes], Event | BaseException] = {}
        for key, answer in zip(wanted, answers, strict=True):
            if isinstance(answer, Event):
                self._fetches.labels(self.runtime.name, "fetched").inc()
            elif isinstance(answer, ProblemError) and answer.problem.status == 422:
                pass  # counted as refused when its partition goes on
            elif isinstance(answer, Exception):
                self._fetches.labels(self.runtime.name, "unavailable").inc()
            else:
                raise answer
            got[key] = answer
        kept: list[tuple[Partition, Any, Event]] = []
        failing: list[tuple[Partition, Any, Event, str]] = []
        taken_out: list[_TakenOut] = []
        for partition, message, e in entries:
            answer = got.get((e.operation_id, e.fingerprint), e)
            if isinstance(answer, Event):
                kept.append((partition, message, answer))
                if (partition, message.offset()) in self._clocked:
                    self._releasable.append((partition, message.offset()))
            elif isinstance(answer, ProblemError) and answer.problem.status == 422:
                taken_out.append(_TakenOut(partition, message, answer, "refused"))
            else:
                detail = answer.problem.detail if isinstance(answer, ProblemError) else ""
                failing.append((partition, message, e, detail or type(answer).__name__))
        unfetched: set[Partition] = set()
        held = self._held_for([(p, m.offset()) for p, m, _e, _d in failing])
        for partition, message, e, detail in failing:
            held_s = held.get((partition, message.offset()), 0.0)
            if held_s < self.hold_limit_s:
                log.warning(
                    "queue: %s's result not fetched yet (its partition is read again): %s",
                    e.operation_id,
                    detail,
                )
                unfetched.add(partition)
                continue
            problem = result_unavailable(
                f"the result could not be fetched for {held_s:.0f} s "
                f"(hold limit {self.hold_limit_s:g} s): {detail}"
            )
            taken_out.append(_TakenOut(partition, message, problem, "unfetchable"))
            self._releasable.append((partition, message.offset()))
        return kept, unfetched, taken_out

    def _held_for(self, records: list[tuple[Partition, int]]) -> dict[tuple[Partition, int], float]:
        """How long each record's result has been unfetchable, by the consumer's database
        clock (shared by its replicas and kept across rebalances and restarts); an empty
        answer (every record held on) if the database does not answer."""
        if not records:
            return {}
        assert self._loop is not None and self._inbox is not None
        self._clocked.update(records)
        try:
            ages = self._loop.run_until_complete(
                self._inbox.held_for([(t, p, o) for (t, p), o in records])
            )
        except (DatabaseUnavailableError, DatabaseError) as exc:
            log.warning("queue: hold clocks not read (the records are held on): %s", exc)
            return {}
        return {((t, p), o): age for (t, p, o), age in ages.items()}

    def _release(self, committed: Mapping[Partition, int]) -> None:
        """Forget the hold clocks of records now committed past (fetched or dead-lettered)."""
        done = [(p, o) for p, o in self._releasable if p in committed and o < committed[p]]
        if not done:
            return
        assert self._loop is not None and self._inbox is not None
        try:
            self._loop.run_until_complete(self._inbox.release([(t, p, o) for (t, p), o in done]))
        except (DatabaseUnavailableError, DatabaseError) as exc:
            # Left behind: never matched again (offsets are not reused), deleted at a start.
            log.info("queue: hold clocks not released: %s", exc)
        gone = set(done)
        self._releasable = [r for r in self._releasable if r not in gone]
        self._clocked -= gone

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

    def _count_taken_out(self, item: _TakenOut) -> None:
        problem = item.problem.problem
        if item.kind == "refused":
            self._fetches.labels(self.runtime.name, "refused").inc()
        if item.kind != "conflict":  # a conflict was counted as such when it was decided
            self._metric.labels(self.runtime.name, problem.slug).inc()
        self._dead_lettered.labels(self.runtime.name, item.kind).inc()
        log.warning(
            "queue record %s[%d]@%d dead-lettered (%s): %s",
            item.partition[0],
            item.partition[1],
            item.offset,
            item.kind,
            problem.detail,
        )

    def _record(self, events: list[Event]) -> dict[str, Recorded] | None:
        assert self._loop is not None and self._inbox is not None
        try:
            results = self._loop.run_until_complete(self._inbox.record_many(events, "queue"))
        except DatabaseUnavailableError as exc:
            log.warning("queue: the batch waits for the database: %s", exc)
            return None
        return {e.operation_id: r for e, r in zip(events, results, strict=True)}


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

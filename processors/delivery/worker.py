"""The delivery worker: the outbox, then the sends (decision 010).

**Outbox.** The worker reads the execution topic in its consumer group. For every SUCCEEDED
execution (confirmed against the log: the fold accepted it) it appends one PENDING per
destination configured for the operation's tenant and tool, and commits its position only after
those appends were acknowledged. The PENDINGs are derived from the SUCCEEDED step alone
(``ledger.domain.delivery.outbox_pendings``), so after a crash between the appends and the commit
the same events are written again and the fold counts them as duplicates: every destination gets
one delivery (the seed's row "after result write, before delivery enqueue").

**Sends.** The partitions the group gave the worker say whose deliveries it sends: the ones the
outbox just opened, and from the projection (checked against the log's tail) the PENDINGs that
are due and the SENTs whose outcome nobody recorded (a worker died after sending: row "after
delivery send, before ACK write"). Each send is recorded SENT *before* it leaves, with the same
``Idempotency-Key`` and body every time, so a receiver recognises a repeat, and only once one of
the webhook sender's connections is there for it: a pass takes no more webhook sends than the
sender has connections, and the others wait as they are, nothing recorded and no attempt spent,
for the next pass (decision 026). Before a send the worker checks policy (DELIVER, as it is
now), the destination (known, enabled) and the stored result; a refusal dead-letters the
delivery with the reason, except a destination an operator disabled: its deliveries wait, as
they are, until it is enabled (decision 021). The destination and the policy are read once more
after the SENTs are acknowledged, just before the sends leave, so a disable, a revocation or a
new target committed meanwhile is obeyed. After it, ``judge`` says ACKED, PENDING again with a
backoff, or DEAD_LETTERED (a send that never left for want of a connection after all: PENDING
again at once, its verdict not an attempt's); a 410 also disables the destination (its later
deliveries are dead-lettered: it said it is gone). A webhook whose address is in a refused
network (loopback, private, link-local, ...: decision 019) is never connected to: its delivery
is dead-lettered with the rule, and the others go on.

The worker loads results by reference and never calls a tool.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from psycopg_pool import ConnectionPool
from pydantic import ValidationError

from ledger.codec import EXECUTION_RECORD, Codec, default_codec
from ledger.destinations import AddressGuard, Destination, DestinationStore, Kind
from ledger.domain import ids
from ledger.domain.delivery import (
    DELIVERY_WORKER,
    Outcome,
    SendResult,
    Verdict,
    judge,
    outbox_pendings,
    take_connections,
)
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, storable_text
from ledger.domain.fold import Applied, DeliveryRecord, ExecutionRecord, apply_delivery
from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.entropy import entropy
from ledger.errors import RecordError
from ledger.faults import fault_point
from ledger.history import HistoryError, HistoryReader
from ledger.kafka import (
    FETCH_STALL_S,
    MESSAGE_MAX_BYTES,
    FetchStallClock,
    listed,
    records_waiting,
)
from ledger.log import (
    LogTopics,
    LogWriter,
    OutgoingRecord,
    Transport,
    fits,
    new_consumer,
    payload_record,
    record_size,
)
from ledger.metrics import Metrics
from ledger.pg import DatabaseUnavailableError, retrying
from ledger.policy_store import PolicyFreshness, PolicyViewStaleError
from ledger.result_fetch import result_url
from ledger.results import ResultStore, StoredResult
from ledger.secrets import cut_tokens, scrub
from ledger.settings import Settings
from processors.delivery.payload import Delivery, queue_headers, webhook_headers
from processors.delivery.senders import AddressRefused, WebhookSend, WebhookSender
from processors.health import Health

log = logging.getLogger("opledger.delivery")

D = DeliveryState
PolicyCheck = Callable[[Sequence[PolicyRequest]], list[PolicyDecision]]

#: Execution records the outbox reads per pass.
OUTBOX_BATCH = 6000
#: Deliveries sent per pass.
SEND_BATCH = 2000
#: How long after its SENT a send's outcome is given up for lost (on top of the destination's
#: request timeout): then it is sent again, with the same key.
SENT_MARGIN = timedelta(seconds=5)
#: A PENDING the outbox opened is sent by the outbox's pass; the projection offers it only
#: once it is this old (a worker that died before sending it).
FRESH_GRACE = timedelta(seconds=2)
#: Records this worker wrote, remembered so that a lagging projection costs no log reads.
KNOWN_LIMIT = 200_000
#: Deliveries remembered in the wait for a connection; past this, one put off is left for the
#: due query to find again in its turn.
WAITING_LIMIT = KNOWN_LIMIT // 2
#: While more deliveries wait for a connection than a pass has room for, the due query (whose
#: oldest rows are those same deliveries) is asked this often rather than every pass.
BACKLOG_QUERY_EVERY_S = 1.0
MAX_ERROR = 1000
_SUCCEEDED_EXECUTION = (EXECUTION_RECORD, ExecutionState.SUCCEEDED.value)

_DUE_SQL = """
SELECT d.operation_id, d.tenant_id, d.destination, d.version
  FROM deliveries d
  JOIN agent_operations o ON o.operation_id = d.operation_id
 WHERE o.kafka_partition = ANY(%(partitions)s)
   AND d.state IN ('PENDING', 'SENT')
   AND CASE WHEN d.state = 'SENT' THEN d.state_entered_at <= now() - %(sent_after)s
            WHEN d.next_attempt_at IS NULL THEN d.state_entered_at <= now() - %(grace)s
            ELSE d.next_attempt_at <= now() END
   AND NOT ((d.tenant_id, d.destination) IN
            (SELECT * FROM unnest(%(paused_tenants)s::text[], %(paused_names)s::text[])))
   -- Held by an operator (decision 021): read again only once enabled, or a destination with
   -- thousands of waiting deliveries would fill every pass's LIMIT and starve the others.
   AND NOT EXISTS (SELECT 1 FROM delivery_destinations x
                    WHERE x.tenant_id = d.tenant_id AND x.name = d.destination
                      AND NOT x.enabled AND NOT x.gone)
 ORDER BY COALESCE(d.next_attempt_at, d.state_entered_at)
 LIMIT %(limit)s
"""

_DEAD_LETTERED_SQL = """
SELECT d.destination, count(*)
  FROM deliveries d
  JOIN agent_operations o ON o.operation_id = d.operation_id
 WHERE o.kafka_partition = ANY(%s) AND d.state = 'DEAD_LETTERED'
 GROUP BY d.destination
"""


def held(destination: Destination | None) -> bool:
    """Whether ``destination``'s deliveries wait rather than go or die: disabled by an
    operator, who enables it again (decision 021). One disabled because it answered 410 Gone
    said it is gone: its deliveries are dead-lettered, for a redrive once someone fixed it."""
    return destination is not None and not destination.enabled and not destination.gone


@dataclass(slots=True)
class _Item:
    """One delivery this pass looks after: its record and its operation's execution."""

    record: DeliveryRecord
    execution: ExecutionRecord
    #: events to append before the send (a lost send's PENDING, then the SENT)
    before: list[DeliveryTransitioned]
    destination: Destination | None = None
    result: StoredResult | None = None
    #: when it was first put off for want of a connection (monotonic); None: never
    waiting_since: float | None = None


@dataclass(slots=True)
class _InFlight:
    """The sends one pass started: the items (recorded SENT), the queue appends' results, and
    the webhooks' answers to come."""

    items: list[_Item]
    done: list[SendResult | None]
    webhook_indexes: list[int]
    answers: Future[list[SendResult]] | None

    def results(self) -> list[SendResult]:
        """Every send's result, in order; waits for the webhooks' answers."""
        if self.answers is not None:
            # The sender answers every send within its timeout; never raises for one.
            for index, result in zip(self.webhook_indexes, self.answers.result(), strict=True):
                self.done[index] = result
        return [r if r is not None else SendResult(None, "not sent") for r in self.done]


class DeliveryWorker:
    """One member of the delivery group; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        pool: ConnectionPool[Any],
        transport: Transport,
        history: HistoryReader,
        results: ResultStore,
        destinations: DestinationStore,
        policy: PolicyCheck,
        webhooks: WebhookSender,
        metrics: Metrics,
        codec: Codec | None = None,
        retry: RetryPolicy | None = None,
        unit_random: Callable[[], float] = random.random,
        outbox_stall_s: float = FETCH_STALL_S,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._transport = transport
        self._history = history
        self._results = results
        self._destinations = destinations
        self._policy = policy
        self._policy_freshness = PolicyFreshness(settings)
        self._webhooks = webhooks
        #: where webhooks may go: checked by the sender at every new connection
        self._guard = AddressGuard(settings.delivery_allowed_networks)
        self._metrics = metrics
        self._codec = codec or default_codec()
        self._log = LogWriter(transport, LogTopics.of(settings), "delivery", codec=self._codec)
        self._retry = retry or settings.delivery_retry_policy
        self._random = unit_random
        self._stopping = threading.Event()
        self._consumer: Consumer | None = None
        self._assigned: set[int] = set()
        #: partition -> when it was assigned (a partition just assigned is not stalled)
        self._assigned_at: dict[int, float] = {}
        #: (operation id, destination) -> the record as this worker last appended it
        self._known: OrderedDict[tuple[str, str], tuple[DeliveryRecord, ExecutionRecord]] = (
            OrderedDict()
        )
        #: retries this worker scheduled: (when, operation id, destination, record version)
        self._timers: list[tuple[datetime, str, str, int]] = []
        #: due webhook deliveries no connection was free for, first put off first: (operation
        #: id, destination) -> (record version, when first put off). A pass offers as many of
        #: them as the sender has connections, before anything else (decision 026).
        self._waiting: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()
        #: (tenant, destination) -> when a throttled destination may be sent to again
        self._paused: dict[tuple[str, str], datetime] = {}
        self._gauges_at = 0.0
        self._due_asked_at = 0.0
        #: the sends the last pass started, whose outcomes the next pass records
        self._in_flight: _InFlight | None = None
        self._counters: dict[tuple[str, str], Any] = {}
        self._latencies: dict[str, Any] = {}
        self._outbox_stall = FetchStallClock(outbox_stall_s)
        self.health = Health("delivery worker")

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    def run(self, max_passes: int | None = None) -> None:
        """Join the group and work until :meth:`stop` (or ``max_passes``, for tests)."""
        self.join()
        try:
            while not self._stopping.is_set() and (
                max_passes is None or self.health.done < max_passes
            ):
                self.run_once()
        finally:
            self.close()

    def join(self) -> None:
        consumer = new_consumer(
            self._settings,
            group_id=self._settings.delivery_group,
            client_id="opledger-delivery",
            overrides={
                "partition.assignment.strategy": "cooperative-sticky",
                # A SIGKILLed worker's partitions move once its session ends: 10 s, not the
                # default 45 s, during which nobody would send its deliveries.
                "session.timeout.ms": 10_000,
                "heartbeat.interval.ms": 2_000,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # A new group starts at the beginning: every SUCCEEDED execution on the topic
                # gets its deliveries (those that exist already are recognised as such).
                "auto.offset.reset": "earliest",
            },
        )
        consumer.subscribe(
            [self._settings.execution_topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        self._consumer = consumer

    def close(self) -> None:
        self._drain("closing")
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        self._policy_freshness.close()

    def _drain(self, why: str) -> None:
        """Record the outcomes of the sends in flight before their partitions may move."""
        try:
            self._finish()
        except Exception as exc:  # their SENTs go stale and are sent again, same key
            log.warning("outcomes of the sends in flight not recorded (%s): %s", why, exc)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        self._assigned |= {p.partition for p in partitions}
        self._assigned_at.update((p.partition, time.monotonic()) for p in partitions)
        self.health.partitions = tuple(sorted(self._assigned))
        log.info("delivery worker now looks after partitions %s", sorted(self._assigned))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The next owner must find the outcomes of this worker's sends, not SENTs to redo.
        self._drain("partitions revoked")
        self._assigned -= {p.partition for p in partitions}
        consumer.incremental_unassign(partitions)
        self.health.partitions = tuple(sorted(self._assigned))
        # Another worker may write these deliveries now: what we remember may go stale.
        self._known.clear()
        self._timers.clear()
        self._waiting.clear()

    @property
    def partitions(self) -> set[int]:
        return set(self._assigned)

    # -- one pass ----------------------------------------------------------------------------

    def run_once(self, timeout: float | None = None) -> int:
        """Read the outbox (waiting up to ``timeout`` for records), record the outcomes of the
        sends the previous pass started, then start the sends that are due now; returns how
        many sends were started. Never raises for a dependency that is away.

        A pass's sends are in flight while the next pass reads its outbox: the two touch
        different deliveries (an outbox opens new ones only), and every delivery's steps stay
        in order: SENT acknowledged, then the request, then its outcome appended, before the
        pass that follows picks anything to send."""
        assert self._consumer is not None, "join() first"
        wait = self._settings.delivery_interval_ms / 1000 if timeout is None else timeout
        started = time.monotonic()
        try:
            try:
                # With sends in flight there is work waiting: read only what has arrived.
                fresh = self._outbox(0.0 if self._in_flight is not None else wait)
            finally:
                self._finish()
            sent = self._deliver(fresh)
            self._metrics.delivery_pool_waiting.set(len(self._waiting))
        except (
            DatabaseUnavailableError,
            HistoryError,
            KafkaException,
            RecordError,
            PolicyViewStaleError,
        ) as exc:
            self.health.stalled(f"{type(exc).__name__}: {exc}")
            log.warning("delivery pass failed, trying again next pass: %s", exc)
            self._stopping.wait(1.0)
            return 0
        self._report_dead_letters()
        self.health.ok()
        self._metrics.delivery_pass_seconds.observe(time.monotonic() - started)
        return sent

    # -- the outbox ----------------------------------------------------------------------------

    def _outbox(self, wait: float) -> list[_Item]:
        assert self._consumer is not None
        messages = self._consumer.consume(num_messages=OUTBOX_BATCH, timeout=wait)
        if messages:
            self._outbox_stall.arrived()
        else:
            self._check_outbox()
        positions: dict[tuple[str, int], int] = {}
        succeeded: dict[str, str] = {}
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("outbox read: %s", error)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None:
                continue
            positions[(topic, partition)] = offset + 1
            event = self._decode_if_succeeded(message)
            if (
                isinstance(event, ExecutionTransitioned)
                and event.state is ExecutionState.SUCCEEDED
                and event.result_ref is not None
            ):
                succeeded[event.operation_id] = event.tenant_id
        fresh: list[_Item] = []
        if succeeded:
            try:
                fresh = self._open_deliveries(succeeded)
            except BaseException:
                # Read, not acted on: read it again next pass, or its deliveries would open
                # only when some later reader starts from the committed offset.
                self._rewind(messages)
                raise
            fault_point("deliver.after_enqueue_before_commit")
        if positions:
            offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                # A rebalance took the partition: its next owner derives the same PENDINGs.
                log.info("outbox position not committed (%s); the next reader repeats it", exc)
        return fresh

    def _check_outbox(self) -> None:
        """Nothing read for a while: ask the broker whether SUCCEEDED records wait beyond this
        worker's positions. If they do, its consumer stopped fetching (it says nothing): leave
        the group and join again, reading from the committed positions, as a restarted worker
        would; the deliveries of what was read twice are recognised, not opened again."""
        if self._consumer is None or not self._outbox_stall.look_due():
            return
        assignment = self._consumer.assignment()
        if not assignment:
            return
        behind = records_waiting(self._consumer, self._outbox_positions(assignment))
        if not behind:
            return
        log.warning(
            "delivery worker read nothing from its outbox for %.0fs while records wait on the "
            "broker (%s); leaving and joining its group again",
            self._outbox_stall.bound_s,
            listed(behind),
        )
        self._metrics.delivery_outbox_rejoins.inc()
        self._outbox_stall.remedied()
        self._drain("rejoining the group")
        consumer, self._consumer = self._consumer, None
        consumer.close()
        self._assigned.clear()
        self._known.clear()
        self._timers.clear()
        self._waiting.clear()
        self.health.partitions = ()
        self.join()

    def _outbox_positions(self, assignment: list[TopicPartition]) -> dict[tuple[str, int], int]:
        """Where the outbox reads next on each assigned partition: the consumer's position, or,
        on a partition it has read nothing from since it was assigned longer than the bound
        ago, the committed offset (a partition just assigned may simply be starting)."""
        assert self._consumer is not None
        positions: dict[tuple[str, int], int] = {}
        unread: list[TopicPartition] = []
        settled = time.monotonic() - self._outbox_stall.bound_s
        for tp in self._consumer.position(assignment):
            if tp.offset >= 0:
                positions[(tp.topic, tp.partition)] = tp.offset
            elif self._assigned_at.get(tp.partition, settled) <= settled:
                unread.append(TopicPartition(tp.topic, tp.partition))
        if unread:
            try:
                for tp in self._consumer.committed(unread, timeout=2):
                    positions[(tp.topic, tp.partition)] = max(tp.offset, 0)
            except KafkaException:
                pass  # not asked about now: the next look tries again
        return positions

    def _rewind(self, messages: Sequence[Message]) -> None:
        """Seek each partition of ``messages`` back to its first record in them."""
        assert self._consumer is not None
        first: dict[tuple[str, int], int] = {}
        for message in messages:
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None or message.error():
                continue
            first.setdefault((topic, partition), offset)
        for (topic, partition), offset in first.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:  # revoked meanwhile: its next owner reads it
                log.info("outbox not rewound on %s[%d]: %s", topic, partition, exc)

    def _decode_if_succeeded(self, message: Message) -> Any:
        """The record's event if it may be a SUCCEEDED execution, else None. Two records of
        three on the execution topic are not (the intent, the dispatch): a peek at the state
        skips them unread; the rest are decoded and validated in full."""
        value = message.value()
        if value is None:
            return None
        peeked = self._codec.peek_state(value)
        if peeked is not None and peeked != _SUCCEEDED_EXECUTION:
            return None
        try:
            return self._codec.decode(value)
        except Exception:  # poison is the projector's to dead-letter; here it is only skipped
            return None

    def _open_deliveries(self, succeeded: dict[str, str]) -> list[_Item]:
        snapshots = self._history.load(succeeded.items())
        executions = [
            s.execution
            for s in snapshots.values()
            # The fold may have refused the SUCCEEDED we read (fenced, a conflict).
            if s.execution is not None and s.execution.state is ExecutionState.SUCCEEDED
        ]
        configured = self._destinations.configured({(e.tenant_id, e.tool_name) for e in executions})
        events: list[DeliveryTransitioned] = []
        fresh: list[_Item] = []
        for execution in executions:
            existing = snapshots[execution.operation_id].deliveries
            names = [
                n
                for n in configured.get((execution.tenant_id, execution.tool_name), ())
                if n not in existing
            ]
            for event in self._pendings(execution, names):
                outcome = apply_delivery(None, event, execution)
                if not isinstance(outcome, Applied):
                    log.error("outbox PENDING refused by the fold: %s", outcome)
                    continue
                events.append(event)
                fresh.append(_Item(outcome.record, execution, []))
        self._append(events)
        self._metrics.outbox_deliveries.inc(len(events))
        for item in fresh:
            self._remember(item.record, item.execution)
        return fresh

    def _pendings(self, execution: ExecutionRecord, names: list[str]) -> list[DeliveryTransitioned]:
        """The outbox's PENDINGs for ``execution``, less any destination no event can name (a
        row the registry's checks did not see, written before them or by hand): that one is
        logged and counted, and every other destination, of this tenant and the others, goes
        on. Without this, one such row made every pass raise and the worker exit, for good."""
        try:
            return outbox_pendings(execution, names)
        except ValidationError:
            pass
        pendings: list[DeliveryTransitioned] = []
        for name in names:
            try:
                pendings.extend(outbox_pendings(execution, [name]))
            except ValidationError:
                self._metrics.deliveries.labels("unrecordable", "refused").inc()
                # The name is not logged: the contract refused it as credential-shaped or
                # malformed.
                log.error(
                    "tenant %s has a destination no delivery event can name (fix it in the "
                    "registry); %s is not delivered there",
                    execution.tenant_id,
                    execution.operation_id,
                )
        return pendings

    # -- the sends -----------------------------------------------------------------------------

    def _deliver(self, fresh: list[_Item]) -> int:
        """Pick what is due, refuse what may not be sent, record the rest SENT and start
        their sends (their outcomes are recorded by :meth:`_finish`)."""
        assert self._in_flight is None, "the previous pass's sends are finished first"
        now = datetime.now(UTC)
        # The previous pass's sends are all answered (_finish): every connection is free.
        connections = self._webhooks.connections
        waited = self._waited(min(connections, SEND_BATCH))
        fresh = fresh[: SEND_BATCH - len(waited)]
        candidates = waited + fresh + self._due(now, SEND_BATCH - len(waited) - len(fresh))
        unique: dict[tuple[str, str], _Item] = {}
        for candidate in candidates:
            key = (candidate.record.tenant_id, candidate.record.destination)
            if key in self._paused and self._paused[key] > now:
                continue  # a throttled destination: its deliveries wait until it may be sent to
            unique.setdefault(
                (candidate.record.operation_id, candidate.record.destination), candidate
            )
        items = list(unique.values())
        if not items:
            return 0
        self._attach_destinations(items)
        # A connection is taken before the SENT is recorded (decision 026).
        items, put_off = take_connections(
            items, connections, lambda item: self._needs_connection(item, now)
        )
        self._wait_for_connection(items, put_off, now)
        if not items:
            return 0
        self._attach_results(items)
        stale = self._policy_freshness.stale_reason()
        if stale is not None:
            # Nothing is sent or dead-lettered on a view that may lack a revocation: every
            # delivery waits, as it is, for a view that can be vouched for (decision 022).
            raise PolicyViewStaleError(stale)
        sends: list[_Item] = []
        refused: list[tuple[_Item, DeliveryTransitioned]] = []
        for item, decision in zip(items, self._decisions(items, now), strict=True):
            if self._sent_recently(item, now):
                continue  # its send may still be under way
            if held(item.destination):
                continue  # waits, as it is, until an operator enables the destination again
            reason = self._refusal(item, decision, now)
            if reason is not None:
                dead = self._event(item.record, D.DEAD_LETTERED, item.record.attempts, now, reason)
                refused.append((item, dead))
                continue
            item.before.append(self._event(item.record, D.SENT, item.record.attempts + 1, now))
            sends.append(item)
        # Recorded SENT before anything leaves: a crash from here on leaves a SENT whose
        # outcome is unknown, which is sent again (same key) once it is stale. A refusal
        # needs no send: it is recorded with them.
        self._append([e for i in sends for e in i.before] + [dead for _i, dead in refused])
        for item in sends:
            for event in item.before:
                item.record = self._applied(item.record, event, item.execution)
        for item, dead in refused:
            item.record = self._applied(item.record, dead, item.execution)
            self._refused_counter(item.record.destination).inc()
        if not sends:
            return 0
        fault_point("deliver.after_sent_before_send")
        sends = self._last_look(sends, now)
        if not sends:
            return 0
        self._in_flight = self._send(sends, now)
        return len(sends)

    def _last_look(self, sends: list[_Item], now: datetime) -> list[_Item]:
        """``sends`` less those an operator stopped while their SENTs were being appended: the
        destination and the policy are read once more, so a disable, a revocation or a new
        target committed before this point is obeyed (decision 021). One destination read and
        one policy read per pass. A held one goes back to PENDING, unsent; a refused one is
        dead-lettered; the rest go to the destination as it is now."""
        current = self._destinations.get_many(
            (i.record.tenant_id, i.record.destination) for i in sends
        )
        decisions = self._decisions(sends, now)
        stale = self._policy_freshness.stale_reason()
        going: list[_Item] = []
        stopped: list[tuple[_Item, DeliveryTransitioned]] = []
        for item, decision in zip(sends, decisions, strict=True):
            record = item.record
            destination = current.get((record.tenant_id, record.destination))
            reason: str | None = None
            if stale is not None:
                # Held, not refused: the view may as well lack a grant as a revocation.
                stopped.append(
                    (
                        item,
                        self._event(record, D.PENDING, record.attempts, now, f"not sent: {stale}"),
                    )
                )
                continue
            if destination is None:
                reason = f"no destination named {record.destination} for tenant {record.tenant_id}"
            elif held(destination):
                stopped.append(
                    (
                        item,
                        self._event(
                            record,
                            D.PENDING,
                            record.attempts,
                            now,
                            f"not sent: destination {record.destination} was disabled before "
                            "the send left; it waits until the destination is enabled",
                        ),
                    )
                )
                continue
            elif not destination.enabled:
                reason = (
                    f"destination {record.destination} is disabled: "
                    f"{destination.disabled_reason or 'by an operator'}"
                )
            elif not decision.allowed:
                reason = f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
            if reason is not None:
                stopped.append(
                    (item, self._event(record, D.DEAD_LETTERED, record.attempts, now, reason))
                )
                continue
            item.destination = destination
            going.append(item)
        if stopped:
            self._append(event for _i, event in stopped)
            for item, event in stopped:
                item.record = self._applied(item.record, event, item.execution)
                if item.record.state is D.DEAD_LETTERED:
                    self._refused_counter(item.record.destination).inc()
        return going

    def _decisions(self, items: Sequence[_Item], now: datetime) -> list[PolicyDecision]:
        """Policy as it is now for each item; asked once per distinct request of the batch."""
        requests: dict[tuple[str, str, str, str], int] = {}
        asked: list[PolicyRequest] = []
        positions: list[int] = []
        for item in items:
            key = (
                item.execution.tenant_id,
                item.execution.actor_id,
                item.execution.tool_name,
                item.record.destination,
            )
            position = requests.get(key)
            if position is None:
                position = requests[key] = len(asked)
                asked.append(
                    PolicyRequest(
                        tenant_id=key[0],
                        actor_id=key[1],
                        tool_name=key[2],
                        purpose=Purpose.DELIVER,
                        now=now,
                        destination=key[3],
                    )
                )
            positions.append(position)
        decisions = self._policy(asked)
        return [decisions[p] for p in positions]

    def _finish(self) -> None:
        """Wait for the sends in flight and record each one's outcome (after the send, always:
        a crash before this leaves SENTs that are sent again once stale)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        sends = in_flight.items
        results = in_flight.results()
        fault_point("deliver.after_send_before_ack")
        after = datetime.now(UTC)
        verdicts = [
            # An address the guard refuses is refused at every send until it is allowed: a
            # lasting failure, dead-lettered at once (like a 413), for a redrive after that.
            Verdict(Outcome.DEAD_LETTERED, reason=result.detail)
            if isinstance(result, AddressRefused)
            else judge(
                result,
                round_attempts=item.record.round_attempts,
                round_start=item.record.round_start,
                now=after,
                policy=self._retry,
                unit_random=self._random(),
            )
            for item, result in zip(sends, results, strict=True)
        ]
        self._log_refused(sends, results)
        self._disable_gone(sends, verdicts)
        finals: list[DeliveryTransitioned] = []
        for item, verdict in zip(sends, verdicts, strict=True):
            finals.append(self._verdict_event(item, verdict, after))
            if verdict.outcome is Outcome.THROTTLED and verdict.next_attempt_at is not None:
                key = (item.record.tenant_id, item.record.destination)
                self._paused[key] = max(self._paused.get(key, after), verdict.next_attempt_at)
        self._append(finals)
        for item, event, verdict in zip(sends, finals, verdicts, strict=True):
            item.record = self._applied(item.record, event, item.execution)
            destination = item.record.destination
            self._outcome_counter(destination, verdict.outcome).inc()
            if verdict.outcome is Outcome.ACKED:
                self._ack_latency(destination).observe(
                    max((after - item.execution.state_entered_at).total_seconds(), 0.0)
                )

    def _outcome_counter(self, destination: str, outcome: Outcome) -> Any:
        key = (destination, outcome.value)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self._metrics.deliveries.labels(*key)
        return child

    def _refused_counter(self, destination: str) -> Any:
        key = (destination, "refused")
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self._metrics.deliveries.labels(*key)
        return child

    def _ack_latency(self, destination: str) -> Any:
        child = self._latencies.get(destination)
        if child is None:
            child = self._metrics.confirmation_to_ack_seconds.labels(destination)
            self._latencies[destination] = child
        return child

    def _due(self, now: datetime, limit: int) -> list[_Item]:
        """Due deliveries of this worker's partitions, as the log says they are now."""
        if limit <= 0 or not self._assigned:
            return []
        self._paused = {k: v for k, v in self._paused.items() if v > now}
        paused = sorted(self._paused)

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                _DUE_SQL,
                {
                    "partitions": sorted(self._assigned),
                    "sent_after": timedelta(milliseconds=100) + SENT_MARGIN,
                    "grace": FRESH_GRACE,
                    "paused_tenants": [p[0] for p in paused],
                    "paused_names": [p[1] for p in paused],
                    "limit": limit - len(items),
                },
            ).fetchall()

        items: list[_Item] = []
        # The retries this worker scheduled itself are due without waiting for the projection.
        while self._timers and self._timers[0][0] <= now and len(items) < limit:
            _at, op_id, destination, version = heapq.heappop(self._timers)
            if (op_id, destination) in self._waiting:
                continue  # it waits for a connection, in its place
            known = self._known.get((op_id, destination))
            if known is not None and known[0].version == version:
                items.append(_Item(known[0], known[1], []))
        taken = {(i.record.operation_id, i.record.destination) for i in items}
        rows = (
            retrying(self._pool, "find due deliveries", work)
            if self._ask_due(limit - len(items))
            else []
        )
        unknown: dict[str, str] = {}
        wanted: dict[str, set[str]] = {}
        waiting = self._waiting
        for op_id, tenant, destination, version in rows:
            if (op_id, destination) in taken or (op_id, destination) in waiting:
                continue  # already in this pass, or in the wait for a connection
            known = self._known.get((op_id, destination))
            if known is not None and known[0].version >= version:
                # The projection is behind what this worker wrote: what it wrote is current.
                record, execution = known
                if self._is_due(record, now):
                    items.append(_Item(record, execution, []))
                continue
            unknown[op_id] = tenant
            wanted.setdefault(op_id, set()).add(destination)
        if unknown:
            for op_id, snapshot in self._history.load(unknown.items()).items():
                loaded = snapshot.execution
                if loaded is None:
                    continue
                for destination in wanted[op_id]:
                    current = snapshot.deliveries.get(destination)
                    if current is not None and self._is_due(current, now):
                        items.append(_Item(current, loaded, []))
        return items

    def _ask_due(self, room: int) -> bool:
        """Whether this pass asks the projection for due deliveries, with ``room`` for them.
        While the wait for a connection alone could fill that room, its oldest due rows are
        mostly deliveries already waiting: asked once every BACKLOG_QUERY_EVERY_S then (a row
        is never passed over: it is among the oldest once those before it are sent)."""
        if room <= 0:
            return False
        monotonic = time.monotonic()
        if len(self._waiting) >= room and monotonic - self._due_asked_at < BACKLOG_QUERY_EVERY_S:
            return False
        self._due_asked_at = monotonic
        return True

    def _is_due(self, record: DeliveryRecord, now: datetime) -> bool:
        if record.state is D.PENDING:
            return record.next_attempt_at is None or record.next_attempt_at <= now
        # A SENT whose outcome was never recorded; the destination's own timeout is checked
        # in _refusal (it needs the destination), here only the shortest possible one.
        return record.state is D.SENT and (
            now - record.state_entered_at >= timedelta(milliseconds=100) + SENT_MARGIN
        )

    def _attach_destinations(self, items: list[_Item]) -> None:
        """Each item's destination, read in one round trip for the batch."""
        destinations = self._destinations.get_many(
            (i.record.tenant_id, i.record.destination) for i in items
        )
        for item in items:
            item.destination = destinations.get((item.record.tenant_id, item.record.destination))

    def _attach_results(self, items: list[_Item]) -> None:
        """Each item's stored result, read in one round trip for the batch."""
        results = self._results.get_many(
            (i.execution.tenant_id, i.execution.result_ref)
            for i in items
            if i.execution.result_ref is not None
        )
        for item in items:
            if item.execution.result_ref is not None:
                item.result = results.get((item.execution.tenant_id, item.execution.result_ref))

    def _needs_connection(self, item: _Item, now: datetime) -> bool:
        """Whether ``item`` would leave this pass on one of the sender's connections: a webhook
        neither held nor perhaps still under way. (One that policy then refuses has taken a
        connection of this pass all the same: it is dead-lettered unsent, and the connection
        goes unused until the next pass.)"""
        destination = item.destination
        return (
            destination is not None
            and destination.kind is Kind.WEBHOOK
            and destination.enabled
            and not self._sent_recently(item, now)
        )

    def _waited(self, count: int) -> list[_Item]:
        """The first ``count`` deliveries in the wait for a connection (as many as there are
        connections); those further back wait on, unexamined: a backlog costs a pass what it
        can send, not its length. One this worker no longer knows as it was (forgotten, or
        changed) is left to the due query."""
        items: list[_Item] = []
        while self._waiting and len(items) < count:
            key, (version, since) = self._waiting.popitem(last=False)
            known = self._known.get(key)
            if known is not None and known[0].version == version:
                items.append(_Item(known[0], known[1], [], waiting_since=since))
        return items

    def _wait_for_connection(self, going: list[_Item], put_off: list[_Item], now: datetime) -> None:
        """``put_off``: due deliveries no connection was free for. Nothing is recorded for them
        (no SENT, no attempt spent); they join the end of the wait (one that was waiting
        already keeps when it began). ``going``: each webhook send's wait for its connection
        is observed (0 if it never waited)."""
        monotonic = time.monotonic()
        for item in put_off:
            if len(self._waiting) >= WAITING_LIMIT:
                break  # the rest is found again by the due query, in its turn
            key = (item.record.operation_id, item.record.destination)
            since = monotonic if item.waiting_since is None else item.waiting_since
            self._waiting[key] = (item.record.version, since)
            self._remember(item.record, item.execution)
        observe = self._metrics.delivery_pool_wait_seconds.observe
        for item in going:
            if self._needs_connection(item, now):
                observe(0.0 if item.waiting_since is None else monotonic - item.waiting_since)

    def _sent_recently(self, item: _Item, now: datetime) -> bool:
        """A SENT younger than its destination's request timeout (plus a margin): its send may
        still be waiting for an answer somewhere."""
        if item.record.state is not D.SENT:
            return False
        timeout = timedelta(milliseconds=item.destination.timeout_ms if item.destination else 0)
        return now - item.record.state_entered_at < timeout + SENT_MARGIN

    def _refusal(self, item: _Item, decision: PolicyDecision, now: datetime) -> str | None:
        """Why ``item`` must not be sent (it is dead-lettered with that reason), or None.
        A stale SENT gets the PENDING that records its lost outcome added to ``item.before``."""
        record, destination = item.record, item.destination
        if destination is None:
            return f"no destination named {record.destination} for tenant {record.tenant_id}"
        if not destination.enabled:
            return (
                f"destination {record.destination} is disabled: "
                f"{destination.disabled_reason or 'by an operator'}"
            )
        if not decision.allowed:
            return f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
        if item.result is None:
            return "the result is not in the result store (it cannot be delivered)"
        if record.round_attempts >= self._retry.max_attempts:
            return f"no attempts left in this round ({record.round_attempts} made)"
        if record.state is D.SENT:
            item.before.append(
                self._event(
                    record,
                    D.PENDING,
                    record.attempts,
                    now,
                    f"the outcome of send {record.attempts} was never recorded (its worker went "
                    "away); sending again with the same Idempotency-Key",
                )
            )
        return None

    def _send(self, sends: list[_Item], now: datetime) -> _InFlight:
        """Start the sends of ``sends`` (SENT already recorded): queue records are appended
        here and now, webhooks go out on the sender's loop while the worker reads on."""
        results: list[SendResult | None] = [None] * len(sends)
        webhooks: list[tuple[int, WebhookSend]] = []
        queues: dict[str, list[tuple[int, OutgoingRecord]]] = {}
        for index, item in enumerate(sends):
            destination, stored = item.destination, item.result
            assert destination is not None and stored is not None
            # A queue goes by reference only if its consumer can sign the fetch (decision 016).
            by_reference = (
                destination.kind is Kind.WEBHOOK or destination.secret is not None
            ) and len(stored.payload) > self._settings.delivery_inline_max_bytes
            delivery = Delivery(
                operation_id=item.record.operation_id,
                tenant_id=item.record.tenant_id,
                tool_name=item.execution.tool_name,
                destination=item.record.destination,
                result_ref=item.execution.result_ref or "",
                content_type=stored.content_type,
                result=stored.payload,
                result_url=result_url(
                    self._settings.results_base_url,
                    item.record.tenant_id,
                    item.record.destination,
                    item.record.operation_id,
                )
                if by_reference
                else None,
            )
            body = delivery.body()
            if destination.kind is Kind.WEBHOOK:
                assert destination.secret is not None
                # During a rotation's overlap, signed with the old secret too: a receiver that
                # has either accepts the send.
                webhooks.append(
                    (
                        index,
                        WebhookSend(
                            destination.target,
                            webhook_headers(
                                delivery,
                                body,
                                destination.secret,
                                now,
                                also=destination.signing_secrets(now)[1:],
                            ),
                            body,
                            destination.timeout_ms / 1000,
                        ),
                    )
                )
            else:
                record = payload_record(
                    destination.target, delivery.operation_id, body, queue_headers(delivery)
                )
                if fits(record):
                    queues.setdefault(destination.target, []).append((index, record))
                else:  # refused alone: sent with the others, it would fail them all each pass
                    results[index] = SendResult(
                        None,
                        f"a record of {record_size(record)} bytes, over the {MESSAGE_MAX_BYTES} "
                        f"a producer may send to {destination.target} (give the destination a "
                        "fetch secret to send results this large by reference)",
                        too_large=True,
                    )
        answers = (
            self._webhooks.start_many([w for _i, w in webhooks], guard=self._guard)
            if webhooks
            else None
        )
        for topic, records in queues.items():
            started = time.monotonic()
            try:
                self._transport.send([r for _i, r in records])
                outcome = SendResult(200, "appended to " + topic)
            except RecordError as exc:
                outcome = SendResult(None, f"the queue topic did not take it: {exc}")
            self._metrics.delivery_send_seconds.labels("queue").observe(time.monotonic() - started)
            for index, _record in records:
                results[index] = outcome
        return _InFlight(sends, results, [i for i, _w in webhooks], answers)

    def _log_refused(self, sends: Sequence[_Item], results: Sequence[SendResult]) -> None:
        refused = {
            (i.record.tenant_id, i.record.destination): r.detail
            for i, r in zip(sends, results, strict=True)
            if isinstance(r, AddressRefused)
        }
        for (tenant, name), reason in refused.items():
            log.warning("destination %s of tenant %s not connected to: %s", name, tenant, reason)

    def _disable_gone(self, sends: Sequence[_Item], verdicts: Sequence[Verdict]) -> None:
        gone = {
            (i.record.tenant_id, i.record.destination): v.reason
            for i, v in zip(sends, verdicts, strict=True)
            if v.outcome is Outcome.DISABLED
        }
        for (tenant, name), reason in gone.items():
            self._destinations.set_enabled(
                tenant, name, enabled=False, changed_by=DELIVERY_WORKER, reason=reason, gone=True
            )
            log.warning("destination %s of tenant %s disabled: %s", name, tenant, reason)

    def _verdict_event(self, item: _Item, verdict: Verdict, now: datetime) -> DeliveryTransitioned:
        record = item.record
        if verdict.outcome is Outcome.ACKED:
            return self._event(record, D.ACKED, record.attempts, now)
        if verdict.outcome in (Outcome.RETRY, Outcome.THROTTLED, Outcome.NOT_SENT):
            return self._event(
                record,
                D.PENDING,
                record.attempts,
                now,
                verdict.reason,
                next_attempt_at=verdict.next_attempt_at,
            )
        return self._event(record, D.DEAD_LETTERED, record.attempts, now, verdict.reason)

    # -- records -----------------------------------------------------------------------------

    def _event(
        self,
        record: DeliveryRecord,
        state: DeliveryState,
        attempt: int,
        now: datetime,
        error: str | None = None,
        *,
        next_attempt_at: datetime | None = None,
    ) -> DeliveryTransitioned:
        return DeliveryTransitioned(
            event_id=ids.event_id(time.time_ns() // 1_000_000, entropy(10)),
            operation_id=record.operation_id,
            tenant_id=record.tenant_id,
            actor_id=DELIVERY_WORKER,
            occurred_at=now,
            attempt=attempt,
            destination=record.destination,
            state=state,
            result_ref=record.result_ref,
            next_attempt_at=next_attempt_at,
            error=None if error is None else scrub(storable_text(cut_tokens(error, MAX_ERROR))),
        )

    def _applied(
        self, record: DeliveryRecord, event: DeliveryTransitioned, execution: ExecutionRecord
    ) -> DeliveryRecord:
        outcome = apply_delivery(record, event, execution)
        if not isinstance(outcome, Applied):
            raise RecordError(f"{record.operation_id} {record.destination}: {outcome}")
        self._remember(outcome.record, execution)
        return outcome.record

    def _remember(self, record: DeliveryRecord, execution: ExecutionRecord) -> None:
        key = (record.operation_id, record.destination)
        if record.state is D.PENDING and record.next_attempt_at is not None:
            heapq.heappush(self._timers, (record.next_attempt_at, key[0], key[1], record.version))
        self._known[key] = (record, execution)
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_LIMIT:
            self._known.popitem(last=False)

    def _append(self, events: Iterable[DeliveryTransitioned]) -> None:
        self._log.append(list(events))

    def _report_dead_letters(self, every_s: float = 5.0) -> None:
        monotonic = time.monotonic()
        if monotonic - self._gauges_at < every_s or not self._assigned:
            return
        self._gauges_at = monotonic

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(_DEAD_LETTERED_SQL, (sorted(self._assigned),)).fetchall()

        try:
            rows = retrying(self._pool, "count dead-lettered deliveries", work)
        except RecordError as exc:
            log.debug("dead-letter gauge not refreshed: %s", exc)
            return
        self._metrics.dead_lettered_deliveries.clear()
        for destination, count in rows:
            self._metrics.dead_lettered_deliveries.labels(destination).set(count)

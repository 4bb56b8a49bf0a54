"""The sender pass: what is due, a connection for each, SENT recorded, the sends started
(decisions 010, 021, 026). (The HTTP client it sends webhooks with is
:class:`processors.delivery.senders.WebhookSender`.)

The partitions the group gave the worker say whose deliveries it sends: the ones the outbox just
opened, and from the projection (checked against the log's tail) the PENDINGs that are due and
the SENTs whose outcome nobody recorded (a worker died after sending: row "after delivery send,
before ACK write"). Each send is recorded SENT *before* it leaves, with the same
``Idempotency-Key`` and body every time, so a receiver recognises a repeat, and only once one of
the webhook sender's connections is there for it: a pass takes no more webhook sends than the
sender has connections, and the others wait as they are, nothing recorded and no attempt spent,
for the next pass (decision 026). Before a send the pass checks policy (DELIVER, as it is now),
the destination (known, enabled) and the stored result; a refusal dead-letters the delivery with
the reason, except a destination an operator disabled: its deliveries wait, as they are, until
it is enabled (decision 021). The destination and the policy are read once more after the SENTs
are acknowledged, just before the sends leave, so a disable, a revocation or a new target
committed meanwhile is obeyed.

It loads results by reference and never calls a tool.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger.destinations import AddressGuard, Destination, DestinationStore, Kind
from ledger.domain.delivery import SendResult, take_connections
from ledger.domain.events import DeliveryTransitioned
from ledger.domain.fold import DeliveryRecord
from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState
from ledger.errors import RecordError
from ledger.faults import fault_point
from ledger.history import HistoryReader
from ledger.kafka import MESSAGE_MAX_BYTES
from ledger.log import OutgoingRecord, Transport, fits, payload_record, record_size
from ledger.metrics import Metrics
from ledger.pg import retrying
from ledger.policy_store import PolicyFreshness, PolicyViewStaleError
from ledger.result_fetch import result_url
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.delivery.payload import Delivery, queue_headers, webhook_headers
from processors.delivery.records import KNOWN_LIMIT, Item, Key, Outcomes, Records, event
from processors.delivery.senders import WebhookSend, WebhookSender

log = logging.getLogger("opledger.delivery")

PolicyCheck = Callable[[Sequence[PolicyRequest]], list[PolicyDecision]]

#: Deliveries sent per pass.
SEND_BATCH = 2000
#: How long after its SENT a send's outcome is given up for lost (on top of the destination's
#: request timeout): then it is sent again, with the same key.
SENT_MARGIN = timedelta(seconds=5)
#: A PENDING the outbox opened is sent by the outbox's pass; the projection offers it only
#: once it is this old (a worker that died before sending it).
FRESH_GRACE = timedelta(seconds=2)
#: Deliveries remembered in the wait for a connection; past this, one put off is left for the
#: due query to find again in its turn.
WAITING_LIMIT = KNOWN_LIMIT // 2
#: While more deliveries wait for a connection than a pass has room for, the due query (whose
#: oldest rows are those same deliveries) is asked this often rather than every pass.
BACKLOG_QUERY_EVERY_S = 1.0

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


def held(destination: Destination | None) -> bool:
    """Whether ``destination``'s deliveries wait rather than go or die: disabled by an
    operator, who enables it again (decision 021). One disabled because it answered 410 Gone
    said it is gone: its deliveries are dead-lettered, for a redrive once someone fixed it."""
    return destination is not None and not destination.enabled and not destination.gone


def refusal(
    record: DeliveryRecord, destination: Destination | None, decision: PolicyDecision
) -> str | None:
    """Why ``record`` may not be sent to ``destination`` under ``decision`` (it is
    dead-lettered with that reason), or None. A held destination is the caller's to look at
    first: its deliveries wait rather than die."""
    if destination is None:
        return f"no destination named {record.destination} for tenant {record.tenant_id}"
    if not destination.enabled:
        return (
            f"destination {record.destination} is disabled: "
            f"{destination.disabled_reason or 'by an operator'}"
        )
    if not decision.allowed:
        return f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
    return None


@dataclass(slots=True)
class InFlight:
    """The sends one pass started: the items (recorded SENT), the queue appends' results, and
    the webhooks' answers to come."""

    items: list[Item]
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


class Sender:
    """The sender pass of one worker: its wait for a connection, its throttled destinations."""

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
        records: Records,
        outcomes: Outcomes,
        metrics: Metrics,
        retry: RetryPolicy,
        partitions: Callable[[], Collection[int]],
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
        self._records = records
        self._outcomes = outcomes
        self._metrics = metrics
        self._retry = retry
        self._partitions = partitions
        #: due webhook deliveries no connection was free for, first put off first: (operation
        #: id, destination) -> (record version, when first put off). A pass offers as many of
        #: them as the sender has connections, before anything else (decision 026).
        self._waiting: OrderedDict[Key, tuple[int, float]] = OrderedDict()
        #: (tenant, destination) -> when a throttled destination may be sent to again
        self._paused: dict[tuple[str, str], datetime] = {}
        self._due_asked_at = 0.0

    def close(self) -> None:
        self._policy_freshness.close()

    @property
    def waiting(self) -> int:
        """How many deliveries wait for a connection."""
        return len(self._waiting)

    def pause(self, tenant: str, destination: str, until: datetime, *, now: datetime) -> None:
        """Send nothing to ``destination`` of ``tenant`` before ``until`` (it throttles)."""
        key = (tenant, destination)
        self._paused[key] = max(self._paused.get(key, now), until)

    def forget(self) -> None:
        """Drop the wait for a connection: the log still has every delivery in it, PENDING,
        for whoever owns it next."""
        self._waiting.clear()

    # -- one pass ------------------------------------------------------------------------------

    def send(self, fresh: list[Item]) -> InFlight | None:
        """Pick what is due (``fresh``: what the outbox just opened), refuse what may not be
        sent, record the rest SENT and start their sends; the sends in flight, whose outcomes
        the judge records, or None if none were started. Every connection must be free: the
        previous pass's sends are all answered."""
        now = datetime.now(UTC)
        connections = self._webhooks.connections
        waited = self._waited(min(connections, SEND_BATCH))
        fresh = fresh[: SEND_BATCH - len(waited)]
        candidates = waited + fresh + self.due(now, SEND_BATCH - len(waited) - len(fresh))
        unique: dict[Key, Item] = {}
        for candidate in candidates:
            key = (candidate.record.tenant_id, candidate.record.destination)
            if key in self._paused and self._paused[key] > now:
                continue  # a throttled destination: its deliveries wait until it may be sent to
            unique.setdefault(
                (candidate.record.operation_id, candidate.record.destination), candidate
            )
        items = list(unique.values())
        if not items:
            return None
        self._attach_destinations(items)
        # A connection is taken before the SENT is recorded (decision 026).
        items, put_off = take_connections(
            items, connections, lambda item: self._needs_connection(item, now)
        )
        self._wait_for_connection(items, put_off, now)
        if not items:
            return None
        self._attach_results(items)
        stale = self._policy_freshness.stale_reason()
        if stale is not None:
            # Nothing is sent or dead-lettered on a view that may lack a revocation: every
            # delivery waits, as it is, for a view that can be vouched for (decision 022).
            raise PolicyViewStaleError(stale)
        sends: list[Item] = []
        refused: list[tuple[Item, DeliveryTransitioned]] = []
        for item, decision in zip(items, self._decisions(items, now), strict=True):
            if self._sent_recently(item, now):
                continue  # its send may still be under way
            if held(item.destination):
                continue  # waits, as it is, until an operator enables the destination again
            reason = self._refusal(item, decision, now)
            if reason is not None:
                record = item.record
                dead = event(record, DeliveryState.DEAD_LETTERED, record.attempts, now, reason)
                refused.append((item, dead))
                continue
            sent = event(item.record, DeliveryState.SENT, item.record.attempts + 1, now)
            item.before.append(sent)
            sends.append(item)
        # Recorded SENT before anything leaves: a crash from here on leaves a SENT whose
        # outcome is unknown, which is sent again (same key) once it is stale. A refusal
        # needs no send: it is recorded with them.
        self._records.append([e for i in sends for e in i.before] + [d for _i, d in refused])
        for item in sends:
            for step in item.before:
                item.record = self._records.applied(item.record, step, item.execution)
        for item, dead in refused:
            item.record = self._records.applied(item.record, dead, item.execution)
            self._outcomes.count(item.record.destination, "refused")
        if not sends:
            return None
        fault_point("deliver.after_sent_before_send")
        sends = self._last_look(sends, now)
        if not sends:
            return None
        return self._send(sends, now)

    def _last_look(self, sends: list[Item], now: datetime) -> list[Item]:
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
        going: list[Item] = []
        stopped: list[tuple[Item, DeliveryTransitioned]] = []
        for item, decision in zip(sends, decisions, strict=True):
            record = item.record
            destination = current.get((record.tenant_id, record.destination))
            waits: str | None = None
            if stale is not None:
                # Held, not refused: the view may as well lack a grant as a revocation.
                waits = f"not sent: {stale}"
            elif held(destination):
                waits = (
                    f"not sent: destination {record.destination} was disabled before the send "
                    "left; it waits until the destination is enabled"
                )
            if waits is not None:
                pending = event(record, DeliveryState.PENDING, record.attempts, now, waits)
                stopped.append((item, pending))
                continue
            reason = refusal(record, destination, decision)
            if reason is not None:
                dead = event(record, DeliveryState.DEAD_LETTERED, record.attempts, now, reason)
                stopped.append((item, dead))
                continue
            item.destination = destination
            going.append(item)
        if stopped:
            self._records.append(step for _i, step in stopped)
            for item, step in stopped:
                item.record = self._records.applied(item.record, step, item.execution)
                if item.record.state is DeliveryState.DEAD_LETTERED:
                    self._outcomes.count(item.record.destination, "refused")
        return going

    def _decisions(self, items: Sequence[Item], now: datetime) -> list[PolicyDecision]:
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

    # -- what is due ---------------------------------------------------------------------------

    def due(self, now: datetime, limit: int) -> list[Item]:
        """Due deliveries of this worker's partitions, as the log says they are now."""
        partitions = sorted(self._partitions())
        if limit <= 0 or not partitions:
            return []
        self._paused = {k: v for k, v in self._paused.items() if v > now}
        paused = sorted(self._paused)
        # The retries this worker scheduled itself are due without waiting for the projection;
        # one waiting for a connection waits in its place.
        items = self._records.fired(now, limit, skip=self._waiting)

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                _DUE_SQL,
                {
                    "partitions": partitions,
                    "sent_after": timedelta(milliseconds=100) + SENT_MARGIN,
                    "grace": FRESH_GRACE,
                    "paused_tenants": [p[0] for p in paused],
                    "paused_names": [p[1] for p in paused],
                    "limit": limit - len(items),
                },
            ).fetchall()

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
            known = self._records.known((op_id, destination))
            if known is not None and known[0].version >= version:
                # The projection is behind what this worker wrote: what it wrote is current.
                record, execution = known
                if self._is_due(record, now):
                    items.append(Item(record, execution, []))
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
                        items.append(Item(current, loaded, []))
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
        if record.state is DeliveryState.PENDING:
            return record.next_attempt_at is None or record.next_attempt_at <= now
        # A SENT whose outcome was never recorded; the destination's own timeout is checked
        # in _refusal (it needs the destination), here only the shortest possible one.
        return record.state is DeliveryState.SENT and (
            now - record.state_entered_at >= timedelta(milliseconds=100) + SENT_MARGIN
        )

    def _attach_destinations(self, items: list[Item]) -> None:
        """Each item's destination, read in one round trip for the batch."""
        destinations = self._destinations.get_many(
            (i.record.tenant_id, i.record.destination) for i in items
        )
        for item in items:
            item.destination = destinations.get((item.record.tenant_id, item.record.destination))

    def _attach_results(self, items: list[Item]) -> None:
        """Each item's stored result, read in one round trip for the batch."""
        results = self._results.get_many(
            (i.execution.tenant_id, i.execution.result_ref)
            for i in items
            if i.execution.result_ref is not None
        )
        for item in items:
            if item.execution.result_ref is not None:
                item.result = results.get((item.execution.tenant_id, item.execution.result_ref))

    # -- the wait for a connection (decision 026) ----------------------------------------------

    def _needs_connection(self, item: Item, now: datetime) -> bool:
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

    def _waited(self, count: int) -> list[Item]:
        """The first ``count`` deliveries in the wait for a connection (as many as there are
        connections); those further back wait on, unexamined: a backlog costs a pass what it
        can send, not its length. One this worker no longer knows as it was (forgotten, or
        changed) is left to the due query."""
        items: list[Item] = []
        while self._waiting and len(items) < count:
            key, (version, since) = self._waiting.popitem(last=False)
            known = self._records.known(key)
            if known is not None and known[0].version == version:
                items.append(Item(known[0], known[1], [], waiting_since=since))
        return items

    def _wait_for_connection(self, going: list[Item], put_off: list[Item], now: datetime) -> None:
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
            self._records.remember(item.record, item.execution)
        observe = self._metrics.delivery_pool_wait_seconds.observe
        for item in going:
            if self._needs_connection(item, now):
                observe(0.0 if item.waiting_since is None else monotonic - item.waiting_since)

    # -- before the send -----------------------------------------------------------------------

    def _sent_recently(self, item: Item, now: datetime) -> bool:
        """A SENT younger than its destination's request timeout (plus a margin): its send may
        still be waiting for an answer somewhere."""
        if item.record.state is not DeliveryState.SENT:
            return False
        timeout = timedelta(milliseconds=item.destination.timeout_ms if item.destination else 0)
        return now - item.record.state_entered_at < timeout + SENT_MARGIN

    def _refusal(self, item: Item, decision: PolicyDecision, now: datetime) -> str | None:
        """Why ``item`` must not be sent (it is dead-lettered with that reason), or None.
        A stale SENT gets the PENDING that records its lost outcome added to ``item.before``."""
        record = item.record
        reason = refusal(record, item.destination, decision)
        if reason is not None:
            return reason
        if item.result is None:
            return "the result is not in the result store (it cannot be delivered)"
        if record.round_attempts >= self._retry.max_attempts:
            return f"no attempts left in this round ({record.round_attempts} made)"
        if record.state is DeliveryState.SENT:
            item.before.append(
                event(
                    record,
                    DeliveryState.PENDING,
                    record.attempts,
                    now,
                    f"the outcome of send {record.attempts} was never recorded (its worker went "
                    "away); sending again with the same Idempotency-Key",
                )
            )
        return None

    # -- the sends -----------------------------------------------------------------------------

    def _send(self, sends: list[Item], now: datetime) -> InFlight:
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
        return InFlight(sends, results, [i for i, _w in webhooks], answers)

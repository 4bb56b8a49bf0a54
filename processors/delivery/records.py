"""What the delivery worker's passes share: the delivery a pass looks after (:class:`Item`), the
one way a delivery event is made (:func:`event`), the records this worker wrote and the retries
it scheduled (:class:`Records`), and the count of each delivery's outcome (:class:`Outcomes`)."""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Container, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ledger.destinations import Destination
from ledger.domain import ids
from ledger.domain.delivery import DELIVERY_WORKER
from ledger.domain.events import DeliveryTransitioned, storable_text
from ledger.domain.fold import Applied, DeliveryRecord, ExecutionRecord, apply_delivery
from ledger.domain.states import DeliveryState
from ledger.entropy import entropy
from ledger.errors import RecordError
from ledger.log import LogWriter
from ledger.metrics import Metrics
from ledger.results import StoredResult
from ledger.secrets import cut_tokens, scrub

#: Records this worker wrote, remembered so that a lagging projection costs no log reads.
KNOWN_LIMIT = 200_000
#: The longest error text a delivery event carries.
MAX_ERROR = 1000

#: (operation id, destination): a delivery
Key = tuple[str, str]


@dataclass(slots=True)
class Item:
    """One delivery this pass looks after: its record and its operation's execution."""

    record: DeliveryRecord
    execution: ExecutionRecord
    #: events to append before the send (a lost send's PENDING, then the SENT)
    before: list[DeliveryTransitioned]
    destination: Destination | None = None
    result: StoredResult | None = None
    #: when it was first put off for want of a connection (monotonic); None: never
    waiting_since: float | None = None


def event(
    record: DeliveryRecord,
    state: DeliveryState,
    attempt: int,
    now: datetime,
    error: str | None = None,
    *,
    next_attempt_at: datetime | None = None,
) -> DeliveryTransitioned:
    """The delivery worker's step of ``record`` to ``state``; ``error`` cut and scrubbed."""
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


class Records:
    """The delivery events this worker appends, the records they made (so that a lagging
    projection costs no log reads) and the retries it scheduled itself."""

    def __init__(self, log: LogWriter) -> None:
        self._log = log
        #: (operation id, destination) -> the record as this worker last appended it
        self._known: OrderedDict[Key, tuple[DeliveryRecord, ExecutionRecord]] = OrderedDict()
        #: retries this worker scheduled: (when, operation id, destination, record version)
        self._timers: list[tuple[datetime, str, str, int]] = []

    def append(self, events: Iterable[DeliveryTransitioned]) -> None:
        """Append ``events``, acknowledged (RecordError otherwise)."""
        self._log.append(list(events))

    def applied(
        self, record: DeliveryRecord, event: DeliveryTransitioned, execution: ExecutionRecord
    ) -> DeliveryRecord:
        """``record`` after the appended ``event``, remembered; RecordError if the fold refuses
        it."""
        outcome = apply_delivery(record, event, execution)
        if not isinstance(outcome, Applied):
            raise RecordError(f"{record.operation_id} {record.destination}: {outcome}")
        self.remember(outcome.record, execution)
        return outcome.record

    def remember(self, record: DeliveryRecord, execution: ExecutionRecord) -> None:
        """Remember ``record`` as this worker wrote it, and its retry if it has one."""
        key = (record.operation_id, record.destination)
        if record.state is DeliveryState.PENDING and record.next_attempt_at is not None:
            heapq.heappush(self._timers, (record.next_attempt_at, key[0], key[1], record.version))
        self._known[key] = (record, execution)
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_LIMIT:
            self._known.popitem(last=False)

    def known(self, key: Key) -> tuple[DeliveryRecord, ExecutionRecord] | None:
        """The delivery ``key`` as this worker last wrote it, if it remembers it."""
        return self._known.get(key)

    def fired(self, now: datetime, limit: int, skip: Container[Key]) -> list[Item]:
        """Up to ``limit`` of the retries this worker scheduled that are due at ``now``, less
        those in ``skip``: due without waiting for the projection. A retry of a record that
        changed since, or was forgotten, is dropped (the due query finds it if it is due)."""
        items: list[Item] = []
        while self._timers and self._timers[0][0] <= now and len(items) < limit:
            _at, op_id, destination, version = heapq.heappop(self._timers)
            if (op_id, destination) in skip:
                continue
            known = self._known.get((op_id, destination))
            if known is not None and known[0].version == version:
                items.append(Item(known[0], known[1], []))
        return items

    def forget(self) -> None:
        """Forget every record and retry: another worker may write these deliveries now."""
        self._known.clear()
        self._timers.clear()


class Outcomes:
    """``opledger_deliveries_total``, one child per destination and outcome, made once."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._children: dict[tuple[str, str], Any] = {}

    def count(self, destination: str, outcome: str) -> None:
        key = (destination, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metrics.deliveries.labels(*key)
        child.inc()

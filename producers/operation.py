"""What this process knows about one operation, and the pure rules for its next event.

No I/O here: a :class:`TrackedOperation` holds the current execution record and per-destination
delivery records, builds the next event with the attempt number the fold expects, and folds it
(:func:`advance`). The recorder sends the event and only then commits the new state to the handle,
so a handle never claims a transition the broker has not acknowledged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, OperationEvent
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    Duplicate,
    ExecutionRecord,
    Rejected,
    RejectionKind,
    apply_control,
    apply_delivery,
    apply_execution,
)
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import ConflictError, IllegalTransitionError, InvalidTransitionError
from ledger.leases import Lease


@dataclass(frozen=True, slots=True)
class OperationState:
    """An immutable snapshot: the execution record (None before the intent is known) and one
    delivery record per destination. Treat ``deliveries`` as read-only; :func:`advance` copies."""

    operation_id: str
    execution: ExecutionRecord | None = None
    deliveries: Mapping[str, DeliveryRecord] = field(default_factory=dict)


def advance(state: OperationState, event: OperationEvent) -> OperationState | None:
    """Fold ``event`` into ``state``: the new snapshot, or None if it is a duplicate.

    Raises :class:`IllegalTransitionError` with the fold's reason when the event is refused
    (:class:`ConflictError` when another event already recorded the same step).
    """
    if event.operation_id != state.operation_id:
        raise IllegalTransitionError(
            f"event for {event.operation_id} folded into {state.operation_id}"
        )
    if not isinstance(event, DeliveryTransitioned):
        outcome = (
            apply_execution(state.execution, event)
            if isinstance(event, ExecutionTransitioned)
            else apply_control(state.execution, event)
        )
        if isinstance(outcome, Applied):
            return OperationState(state.operation_id, outcome.record, state.deliveries)
        _refuse_unless_duplicate(outcome)
        return None
    # The execution travels with the delivery fold: a delivery belongs to a SUCCEEDED execution
    # of the same tenant (ledger.domain.fold.delivery_refusal), so a handle that does not know
    # the execution cannot record a delivery, whichever API built the event.
    delivery = apply_delivery(state.deliveries.get(event.destination), event, state.execution)
    if isinstance(delivery, Applied):
        deliveries = dict(state.deliveries)
        deliveries[event.destination] = delivery.record
        return OperationState(state.operation_id, state.execution, deliveries)
    _refuse_unless_duplicate(delivery)
    return None


def _refuse_unless_duplicate(outcome: Duplicate | Rejected) -> None:
    if isinstance(outcome, Rejected):
        if outcome.kind is RejectionKind.CONFLICT:
            raise ConflictError(outcome.reason)
        raise IllegalTransitionError(outcome.reason)


def next_execution_attempt(current: ExecutionRecord, state: ExecutionState) -> int:
    """The attempt number an event entering ``state`` must carry (see ``fold.apply_execution``).

    DISPATCHED opens a new attempt - except when the operation is already DISPATCHED: then the
    call is a repeat of the same dispatch, gets the same number and folds as a Duplicate.
    """
    if state is ExecutionState.DISPATCHED and current.state is not ExecutionState.DISPATCHED:
        return current.attempt + 1
    return current.attempt


def next_delivery_attempt(current: DeliveryRecord | None, state: DeliveryState) -> int:
    """The attempt number for a delivery event entering ``state`` (see ``fold.apply_delivery``).

    A destination starts at PENDING attempt 0; SENT counts a new send unless the record is
    already SENT (then the call repeats that send and folds as a Duplicate); every other state
    keeps the count.
    """
    if current is None:
        return 0
    if state is DeliveryState.SENT and current.state is not DeliveryState.SENT:
        return current.attempts + 1
    return current.attempts


@dataclass(frozen=True, slots=True)
class InDoubt:
    """Appends whose outcome is unknown (their acknowledgement failed or timed out): the exact
    records to send again, and the state the handle moves to once they are acknowledged."""

    events: tuple[OperationEvent, ...]
    records: tuple[Any, ...]
    advanced: OperationState


class TrackedOperation:
    """One operation's execution and deliveries as known to this process (the SDK's handle).

    Mutated only by the recorder, after the broker acknowledged the event; a lock serialises
    the recorder's calls on one handle so two threads cannot both claim the same next attempt.
    After a failed or timed-out append the handle is *in doubt*: it keeps the unacknowledged
    events, and the only step allowed is sending those identical events again.
    """

    __slots__ = ("_async_lock", "_in_doubt", "_lock", "_state", "lease")

    def __init__(self, state: OperationState, lease: Lease | None = None) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._async_lock: asyncio.Lock | None = None
        self._in_doubt: InDoubt | None = None
        #: the lease this process advances the operation under (None: recorded without leases)
        self.lease = lease

    @classmethod
    def unknown(cls, operation_id: str) -> TrackedOperation:
        """A handle for an operation this process has recorded nothing about yet."""
        return cls(OperationState(operation_id))

    @property
    def state(self) -> OperationState:
        return self._state

    @property
    def operation_id(self) -> str:
        return self._state.operation_id

    @property
    def execution(self) -> ExecutionRecord | None:
        return self._state.execution

    @property
    def deliveries(self) -> Mapping[str, DeliveryRecord]:
        return MappingProxyType(dict(self._state.deliveries))

    @property
    def lock(self) -> threading.Lock:
        """Held by the recorder from building an event until its new state is committed."""
        return self._lock

    @property
    def async_lock(self) -> asyncio.Lock:
        """The asyncio recorder's counterpart of :attr:`lock` (a threading lock cannot be held
        across an ``await`` without blocking the event loop)."""
        if self._async_lock is None:
            self._async_lock = asyncio.Lock()
        return self._async_lock

    @property
    def in_doubt(self) -> InDoubt | None:
        """The unacknowledged appends, if the last one failed; None when the handle is settled."""
        return self._in_doubt

    def require_execution(self) -> ExecutionRecord:
        """The execution record, or IllegalTransitionError if the intent is not recorded."""
        if self._state.execution is None:
            raise IllegalTransitionError(
                f"{self.operation_id}: no INTENT_RECORDED known to this handle"
            )
        return self._state.execution

    def commit(self, state: OperationState) -> None:
        """Adopt ``state`` (the recorder calls this once the broker acknowledged)."""
        if state.operation_id != self.operation_id:
            raise ValueError("cannot commit another operation's state")
        self._state = state
        self._in_doubt = None

    def doubt(self, in_doubt: InDoubt) -> None:
        """Remember appends whose outcome is unknown (the recorder calls this on failure)."""
        if in_doubt.advanced.operation_id != self.operation_id:
            raise ValueError("cannot doubt another operation's appends")
        self._in_doubt = in_doubt

    def __repr__(self) -> str:
        execution = self._state.execution
        where = "no execution" if execution is None else f"{execution.state}#{execution.attempt}"
        deliveries = {d: f"{r.state}#{r.attempts}" for d, r in self._state.deliveries.items()}
        doubt = "" if self._in_doubt is None else f", in doubt: {len(self._in_doubt.events)}"
        return f"TrackedOperation({self.operation_id}, {where}, deliveries={deliveries}{doubt})"


def delivery_result_ref(state: OperationState) -> str | None:
    """The result a delivery of this operation carries: the execution's, when known."""
    return None if state.execution is None else state.execution.result_ref


def as_aware(value: datetime, name: str = "next_attempt_at") -> datetime:
    """Refuse naive datetimes early with a clear message (events need aware timestamps)."""
    if not isinstance(value, datetime):
        raise InvalidTransitionError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None:
        raise InvalidTransitionError(
            f"{name} must be timezone-aware (e.g. datetime.now(UTC)); nothing was sent"
        )
    return value

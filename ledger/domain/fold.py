"""The fold: ``apply(current_record, event) -> outcome``, one function per state machine.

Every writer runs these (the SDK before it sends, the projector before it writes), so a stream
of events means the same thing wherever it is read. An outcome is one of:

- :class:`Applied`: the event is a legal next step; here is the new record.
- :class:`Duplicate`: the same (state, attempt) was already recorded for this operation - what a
  service that retries its own call sends. Counted, never applied twice, not an anomaly.
- :class:`Rejected`: an illegal transition. Recorded as an anomaly with the reason, never applied.

Reasons never name another tenant: an anomaly is shown to the operation's owner, and the id of a
tenant that sent an event for someone else's operation is for operators only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Generic, TypeVar

from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned
from ledger.domain.states import (
    DELIVERY_INITIAL,
    DELIVERY_TRANSITIONS,
    EXECUTION_INITIAL,
    EXECUTION_TRANSITIONS,
    DeliveryState,
    ExecutionState,
)


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    """Current execution state of one operation (a row of ``agent_operations``)."""

    operation_id: str
    tenant_id: str
    actor_id: str
    tool_name: str
    request_hash: str
    state: ExecutionState
    attempt: int
    provider_ref: str | None
    result_ref: str | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    state_entered_at: datetime
    version: int
    #: every (state, attempt) recorded so far: how a retried append is recognised.
    seen: frozenset[tuple[ExecutionState, int]]


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """Current delivery state of one operation's result to one destination (``deliveries``)."""

    operation_id: str
    destination: str
    tenant_id: str
    actor_id: str
    state: DeliveryState
    attempts: int
    result_ref: str | None
    next_attempt_at: datetime | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    state_entered_at: datetime
    version: int
    seen: frozenset[tuple[DeliveryState, int]]


R = TypeVar("R", ExecutionRecord, DeliveryRecord)


@dataclass(frozen=True, slots=True)
class Applied(Generic[R]):
    record: R


@dataclass(frozen=True, slots=True)
class Duplicate:
    reason: str


class RejectionKind(StrEnum):
    """Why an event was refused, for anomaly rows and metrics."""

    ILLEGAL = "illegal"  # not a legal next step of its state machine
    FOREIGN_TENANT = "foreign_tenant"  # sent by another tenant than the operation's owner
    #: a delivery whose execution is not (yet) SUCCEEDED; a reader that may not have seen the
    #: execution topic up to this point yet can wait before calling it an anomaly.
    AWAITING_EXECUTION = "awaiting_execution"


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str
    kind: RejectionKind = RejectionKind.ILLEGAL


#: Shown to the operation's owner; deliberately names no tenant.
FOREIGN_TENANT_REASON = "event from another tenant refused: an operation belongs to its creator"

ExecutionOutcome = Applied[ExecutionRecord] | Duplicate | Rejected
DeliveryOutcome = Applied[DeliveryRecord] | Duplicate | Rejected


def apply_execution(
    current: ExecutionRecord | None, event: ExecutionTransitioned
) -> ExecutionOutcome:
    """Fold one execution event into the operation's current record."""
    if current is None:
        if event.state not in EXECUTION_INITIAL:
            return Rejected(
                f"first event of {event.operation_id} must be INTENT_RECORDED, got {event.state}"
            )
        return Applied(
            ExecutionRecord(
                operation_id=event.operation_id,
                tenant_id=event.tenant_id,
                actor_id=event.actor_id,
                tool_name=event.tool_name,
                request_hash=event.request_hash,
                state=event.state,
                attempt=event.attempt,
                provider_ref=event.provider_ref,
                result_ref=event.result_ref,
                error=event.error,
                created_at=event.occurred_at,
                updated_at=event.occurred_at,
                state_entered_at=event.occurred_at,
                version=1,
                seen=frozenset({(event.state, event.attempt)}),
            )
        )
    if event.operation_id != current.operation_id:
        raise ValueError("apply_execution called with another operation's record")
    # Identity is checked before duplicates: a "retry" from another tenant or for another request
    # is an anomaly to record, not a harmless duplicate to count.
    if event.tenant_id != current.tenant_id:
        return Rejected(FOREIGN_TENANT_REASON, RejectionKind.FOREIGN_TENANT)
    if event.tool_name != current.tool_name or event.request_hash != current.request_hash:
        return Rejected("tool_name or request_hash differs from the recorded intent")
    if (event.state, event.attempt) in current.seen:
        return Duplicate(f"{event.state} attempt {event.attempt} already recorded")
    if event.state not in EXECUTION_TRANSITIONS[current.state]:
        return Rejected(f"illegal execution transition {current.state} -> {event.state}")
    expected_attempt = (
        current.attempt + 1 if event.state is ExecutionState.DISPATCHED else current.attempt
    )
    if event.attempt != expected_attempt:
        return Rejected(
            f"{current.state} -> {event.state} needs attempt {expected_attempt}, "
            f"got {event.attempt}"
        )
    # Built field by field rather than with dataclasses.replace: the fold runs once per event
    # in the projector and the SDK, and replace() costs several times a direct construction.
    occurred_at = event.occurred_at
    return Applied(
        ExecutionRecord(
            operation_id=current.operation_id,
            tenant_id=current.tenant_id,
            actor_id=event.actor_id,
            tool_name=current.tool_name,
            request_hash=current.request_hash,
            state=event.state,
            attempt=event.attempt,
            provider_ref=event.provider_ref or current.provider_ref,
            result_ref=event.result_ref or current.result_ref,
            error=event.error,
            created_at=current.created_at,
            updated_at=occurred_at
            if occurred_at > current.updated_at
            else current.updated_at,  # max()
            state_entered_at=occurred_at,
            version=current.version + 1,
            seen=current.seen | {(event.state, event.attempt)},
        )
    )


def delivery_refusal(
    execution: ExecutionRecord | None, event: DeliveryTransitioned
) -> Rejected | None:
    """The cross-machine rule: a delivery belongs to a SUCCEEDED execution of the same tenant
    and carries that execution's result. None when ``event`` may be folded."""
    if execution is None:
        return Rejected(
            f"delivery to {event.destination} for an operation with no recorded execution",
            RejectionKind.AWAITING_EXECUTION,
        )
    if event.operation_id != execution.operation_id:
        raise ValueError("delivery_refusal called with another operation's execution")
    if event.tenant_id != execution.tenant_id:
        return Rejected(FOREIGN_TENANT_REASON, RejectionKind.FOREIGN_TENANT)
    if execution.state is not ExecutionState.SUCCEEDED or execution.result_ref is None:
        return Rejected(
            f"delivery to {event.destination} before the execution succeeded "
            f"(execution is {execution.state})",
            RejectionKind.AWAITING_EXECUTION,
        )
    if event.result_ref is not None and event.result_ref != execution.result_ref:
        return Rejected(
            f"delivery to {event.destination} carries another result than the execution's"
        )
    return None


def apply_delivery(
    current: DeliveryRecord | None,
    event: DeliveryTransitioned,
    execution: ExecutionRecord | None,
) -> DeliveryOutcome:
    """Fold one delivery event into the (operation, destination) record, given the operation's
    execution record (see :func:`delivery_refusal`)."""
    refusal = delivery_refusal(execution, event)
    if refusal is not None:
        return refusal
    if current is None:
        if event.state not in DELIVERY_INITIAL or event.attempt != 0:
            return Rejected(
                f"first delivery event for {event.destination} must be PENDING attempt 0, "
                f"got {event.state} attempt {event.attempt}"
            )
        return Applied(
            DeliveryRecord(
                operation_id=event.operation_id,
                destination=event.destination,
                tenant_id=event.tenant_id,
                actor_id=event.actor_id,
                state=event.state,
                attempts=0,
                result_ref=event.result_ref,
                next_attempt_at=event.next_attempt_at,
                error=event.error,
                created_at=event.occurred_at,
                updated_at=event.occurred_at,
                state_entered_at=event.occurred_at,
                version=1,
                seen=frozenset({(event.state, event.attempt)}),
            )
        )
    if event.destination != current.destination or event.operation_id != current.operation_id:
        raise ValueError("apply_delivery called with another (operation, destination)'s record")
    if event.tenant_id != current.tenant_id:
        return Rejected(FOREIGN_TENANT_REASON, RejectionKind.FOREIGN_TENANT)
    if (event.state, event.attempt) in current.seen:
        return Duplicate(
            f"{event.destination} {event.state} attempt {event.attempt} already recorded"
        )
    if event.state not in DELIVERY_TRANSITIONS[current.state]:
        return Rejected(
            f"illegal delivery transition {current.state} -> {event.state} ({event.destination})"
        )
    expected_attempt = (
        current.attempts + 1 if event.state is DeliveryState.SENT else current.attempts
    )
    if event.attempt != expected_attempt:
        return Rejected(
            f"{current.state} -> {event.state} needs attempt {expected_attempt}, "
            f"got {event.attempt}"
        )
    occurred_at = event.occurred_at
    return Applied(
        DeliveryRecord(
            operation_id=current.operation_id,
            destination=current.destination,
            tenant_id=current.tenant_id,
            actor_id=event.actor_id,
            state=event.state,
            attempts=event.attempt,
            result_ref=event.result_ref or current.result_ref,
            next_attempt_at=event.next_attempt_at if event.state is DeliveryState.PENDING else None,
            error=event.error,
            created_at=current.created_at,
            updated_at=occurred_at
            if occurred_at > current.updated_at
            else current.updated_at,  # max()
            state_entered_at=occurred_at,
            version=current.version + 1,
            seen=current.seen | {(event.state, event.attempt)},
        )
    )

"""The fold: ``apply(current_record, event) -> outcome``, one function per kind of event.

Every writer runs these (the SDK before it sends, the projector before it writes, the recovery
worker when it reads an operation's history), so a stream of events means the same thing
wherever it is read. An outcome is one of:

- :class:`Applied`: the event is a legal next step; here is the new record.
- :class:`Duplicate`: this very event (same event id) was already recorded - what a service
  resending an append whose acknowledgement it lost sends. Counted, never applied twice.
- :class:`Rejected`: recorded as an anomaly with the reason, never applied. Among the reasons:
  an illegal transition; a *conflict* (another event already recorded this state and attempt);
  a *fenced* writer (its lease token is lower than one already recorded); another tenant.

Reasons never name another tenant: an anomaly is shown to the operation's owner, and the id of a
tenant that sent an event for someone else's operation is for operators only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Generic, TypeVar

from ledger.domain.events import (
    DeliveryTransitioned,
    ExecutionTransitioned,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.reconcile import PARKING, Decision
from ledger.domain.states import (
    DELIVERY_INITIAL,
    DELIVERY_TRANSITIONS,
    EXECUTION_INITIAL,
    EXECUTION_TERMINAL,
    EXECUTION_TRANSITIONS,
    DeliveryState,
    ExecutionState,
)

#: The event id a record remembers for a (state, attempt) recorded before event ids were kept
#: (an old projection row): any repeat of it then counts as a duplicate, as it did then.
UNKNOWN_EVENT = ""

_NO_CONTROLS: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    """Current execution state of one operation (a row of ``agent_operations``)."""

    operation_id: str
    tenant_id: str
    #: the actor the operation is for (its intent's): policy is checked for this actor at
    #: every dispatch and reconciliation, whoever (service, worker, person) wrote later steps;
    #: each event's own actor is in the history.
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
    #: (state, attempt) -> event id of every transition recorded: a resend of the same event is
    #: a duplicate, another event for the same (state, attempt) is a conflict.
    seen: Mapping[tuple[ExecutionState, int], str]
    #: the highest lease token recorded; events with a lower one are fenced (0: none yet)
    lease_token: int = 0
    #: (attempt, decision event id) a NEW_ATTEMPT decision permits; used up by that dispatch
    permit: tuple[int, str] | None = None
    #: why the operation waits for a person (a PARK or REFUSE decision), else None
    parked: str | None = None
    cancelled: bool = False
    #: the last decision recorded and when
    decision: Decision | None = None
    decided_at: datetime | None = None
    #: event ids of the ownership and decision events applied (their duplicates are recognised)
    controls: frozenset[str] = _NO_CONTROLS


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
    #: (state, attempt) -> event id of this round's steps (a redrive starts a new round)
    seen: Mapping[tuple[DeliveryState, int], str]
    #: how many times a person sent the dead-lettered delivery again
    redrives: int = 0
    #: event ids of the steps of earlier rounds: a late copy of one is a duplicate, not news
    retired: frozenset[str] = frozenset()
    #: when the current round began (the last redrive); None: at ``created_at``
    round_started_at: datetime | None = None

    @property
    def round_start(self) -> datetime:
        """When the current round of sends began: the delivery's creation, or its last redrive
        (the retry horizon counts from here)."""
        return self.created_at if self.round_started_at is None else self.round_started_at

    @property
    def round_attempts(self) -> int:
        """Sends made in the current round (a redrive starts a new budget of attempts)."""
        return self.attempts - min(attempt for _state, attempt in self.seen)


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
    #: another event already recorded this (state, attempt): both versions are kept
    CONFLICT = "conflict"
    #: written under a lease that was taken over since (a lower token)
    FENCED = "fenced"


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str
    kind: RejectionKind = RejectionKind.ILLEGAL


#: Shown to the operation's owner; deliberately names no tenant.
FOREIGN_TENANT_REASON = "event from another tenant refused: an operation belongs to its creator"

ExecutionOutcome = Applied[ExecutionRecord] | Duplicate | Rejected
DeliveryOutcome = Applied[DeliveryRecord] | Duplicate | Rejected


S = TypeVar("S", ExecutionState, DeliveryState)


def _seen_with(
    seen: Mapping[tuple[S, int], str], key: tuple[S, int], event_id: str
) -> Mapping[tuple[S, int], str]:
    grown = dict(seen)
    grown[key] = event_id
    return MappingProxyType(grown)


def _repeat(
    seen: Mapping[tuple[S, int], str], key: tuple[S, int], event_id: str, what: str
) -> Duplicate | Rejected | None:
    """Duplicate if this very event was recorded, conflict if another one was, else None."""
    recorded = seen.get(key)
    if recorded is None:
        return None
    if recorded in (event_id, UNKNOWN_EVENT):
        return Duplicate(f"{what} already recorded")
    return Rejected(
        f"conflict: {what} is already recorded as {recorded}; this is another event",
        RejectionKind.CONFLICT,
    )


def _fenced(current: ExecutionRecord, token: int | None) -> Rejected | None:
    if (token or 0) < current.lease_token:
        return Rejected(
            f"fenced: written under lease token {token or 0}, but token "
            f"{current.lease_token} took the operation over",
            RejectionKind.FENCED,
        )
    return None


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
                seen=MappingProxyType({(event.state, event.attempt): event.event_id}),
                lease_token=event.lease_token or 0,
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
    key = (event.state, event.attempt)
    repeat = _repeat(current.seen, key, event.event_id, f"{event.state} attempt {event.attempt}")
    if repeat is not None:
        return repeat
    fenced = _fenced(current, event.lease_token)
    if fenced is not None:
        return fenced
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
    permit = current.permit
    if current.state is ExecutionState.UNKNOWN and event.state is ExecutionState.DISPATCHED:
        # The seed's rule: UNKNOWN is not permission to retry. Only a recorded reconciliation
        # decision that found nothing and was allowed by policy opens the next attempt.
        if permit is None or permit != (event.attempt, event.decision_id):
            return Rejected(
                "a new attempt after UNKNOWN needs a recorded reconciliation decision that "
                "permits it (NEW_ATTEMPT for this attempt, cited as decision_id)"
            )
        permit = None
    # Built field by field rather than with dataclasses.replace: the fold runs once per event
    # in the projector and the SDK, and replace() costs several times a direct construction.
    occurred_at = event.occurred_at
    return Applied(
        ExecutionRecord(
            operation_id=current.operation_id,
            tenant_id=current.tenant_id,
            actor_id=current.actor_id,
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
            seen=_seen_with(current.seen, key, event.event_id),
            lease_token=max(current.lease_token, event.lease_token or 0),
            permit=permit,
            # A transition moves the operation on: whatever parked it no longer holds.
            parked=None,
            cancelled=current.cancelled,
            decision=current.decision,
            decided_at=current.decided_at,
            controls=current.controls,
        )
    )


#: Decisions that may be taken in each state (a decision is about the current attempt).
DECISIONS_BY_STATE: Mapping[ExecutionState, frozenset[Decision]] = MappingProxyType(
    {
        ExecutionState.INTENT_RECORDED: frozenset(
            {Decision.RESUME, Decision.REFUSE, Decision.PARK, Decision.CANCEL}
        ),
        ExecutionState.DISPATCHED: frozenset({Decision.CANCEL}),
        ExecutionState.UNKNOWN: frozenset(Decision) - {Decision.RESUME},
        ExecutionState.SUCCEEDED: frozenset(),
        ExecutionState.FAILED: frozenset(),
    }
)


def apply_control(
    current: ExecutionRecord | None, event: OwnershipTaken | ReconciliationDecided
) -> ExecutionOutcome:
    """Fold an ownership change or a reconciliation decision into the operation's record."""
    what = "ownership" if isinstance(event, OwnershipTaken) else f"decision {event.decision}"
    if current is None:
        return Rejected(f"{what} for an operation with no recorded intent")
    if event.operation_id != current.operation_id:
        raise ValueError("apply_control called with another operation's record")
    if event.tenant_id != current.tenant_id:
        return Rejected(FOREIGN_TENANT_REASON, RejectionKind.FOREIGN_TENANT)
    if event.event_id in current.controls:
        return Duplicate(f"{what} already recorded")
    if current.state in EXECUTION_TERMINAL:
        return Rejected(f"{what} after the execution finished ({current.state})")
    permit, parked, cancelled = current.permit, current.parked, current.cancelled
    decision, decided_at = current.decision, current.decided_at
    if isinstance(event, OwnershipTaken):
        if event.lease_token <= current.lease_token:
            return Rejected(
                f"fenced: ownership claimed with token {event.lease_token}, but token "
                f"{current.lease_token} is already recorded",
                RejectionKind.FENCED,
            )
        token = event.lease_token
    else:
        fenced = _fenced(current, event.lease_token)
        if fenced is not None:
            return fenced
        if event.attempt != current.attempt:
            return Rejected(
                f"{what} is about attempt {event.attempt}, the operation is at {current.attempt}"
            )
        if event.decision not in DECISIONS_BY_STATE[current.state]:
            return Rejected(f"{what} is not a decision to take in {current.state}")
        token = max(current.lease_token, event.lease_token or 0)
        decision, decided_at = event.decision, event.occurred_at
        if event.decision is Decision.NEW_ATTEMPT:
            permit = (current.attempt + 1, event.event_id)
        elif event.decision in PARKING:
            parked = event.reason
        elif event.decision is Decision.CANCEL:
            cancelled = True
    return Applied(
        ExecutionRecord(
            operation_id=current.operation_id,
            tenant_id=current.tenant_id,
            actor_id=current.actor_id,
            tool_name=current.tool_name,
            request_hash=current.request_hash,
            state=current.state,
            attempt=current.attempt,
            provider_ref=current.provider_ref,
            result_ref=current.result_ref,
            error=current.error,
            created_at=current.created_at,
            updated_at=event.occurred_at
            if event.occurred_at > current.updated_at
            else current.updated_at,
            state_entered_at=current.state_entered_at,
            version=current.version + 1,
            seen=current.seen,
            lease_token=token,
            permit=permit,
            parked=parked,
            cancelled=cancelled,
            decision=decision,
            decided_at=decided_at,
            controls=current.controls | {event.event_id},
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
                seen=MappingProxyType({(event.state, event.attempt): event.event_id}),
            )
        )
    if event.destination != current.destination or event.operation_id != current.operation_id:
        raise ValueError("apply_delivery called with another (operation, destination)'s record")
    if event.tenant_id != current.tenant_id:
        return Rejected(FOREIGN_TENANT_REASON, RejectionKind.FOREIGN_TENANT)
    if event.event_id in current.retired:
        return Duplicate(
            f"{event.destination} {event.state} attempt {event.attempt}, an earlier round"
        )
    key = (event.state, event.attempt)
    repeat = _repeat(
        current.seen,
        key,
        event.event_id,
        f"{event.destination} {event.state} attempt {event.attempt}",
    )
    # A resend of any step of the round is a duplicate. A *new* PENDING after a dead letter is
    # not a rival version of the round's PENDING but a redrive, which opens the next round.
    starts_round = (
        current.state is DeliveryState.DEAD_LETTERED and event.state is DeliveryState.PENDING
    )
    if repeat is not None and (isinstance(repeat, Duplicate) or not starts_round):
        return repeat
    if event.state not in DELIVERY_TRANSITIONS[current.state]:
        return Rejected(
            f"illegal delivery transition {current.state} -> {event.state} ({event.destination})"
        )
    redrive = starts_round
    if redrive and not event.error:
        return Rejected(
            f"a redrive of {event.destination} needs a reason (who sends it again, and why)"
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
            actor_id=current.actor_id,
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
            # A redrive starts a new round: the steps of the round it ended cannot repeat.
            seen=MappingProxyType({key: event.event_id})
            if redrive
            else _seen_with(current.seen, key, event.event_id),
            redrives=current.redrives + 1 if redrive else current.redrives,
            retired=current.retired.union(current.seen.values()) if redrive else current.retired,
            round_started_at=occurred_at if redrive else current.round_started_at,
        )
    )

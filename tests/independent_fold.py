"""The tests' own fold of the log: what the projections must hold, written again from the
contract rather than imported from the projector's (``ledger.domain.fold``), so that a defect
there shows up as a difference here instead of being copied into the expectation.

Sources, and nothing else:

- the state symbols of ``schemas/*.avsc`` (read from the files; the tables below must name
  exactly those), and the fields' docs there: a resend carries the same ``event_id``; the
  intent is attempt 0 and each dispatch adds one; a delivery's attempt counts its sends; a
  lower ``lease_token`` than one recorded is fenced; an ``UNKNOWN -> DISPATCHED`` new attempt
  cites, as ``decision_id``, a ``ReconciliationDecided`` that permits it; an ``OwnershipTaken``
  carries a token greater than every earlier one;
- the seed's rules (``/work/shared/seed``): the two state machines and their states;
  ``UNKNOWN`` is neither a failure nor permission to retry, and only a recorded decision that
  policy allows opens a new attempt; delivery is retried, never execution; an operation
  belongs to its tenant;
- the projection's documented row shape (``projections/migrations``): one row per operation
  and per (operation, destination), with ``seen`` (the event that recorded each (state,
  attempt)), ``controls`` (ownership and decision events applied), the lease token, the permit
  a NEW_ATTEMPT decision grants, why the operation is parked, the last decision, the redrives.

It folds in a different style on purpose: plain mutable records judged first, changed only
when the event is applied, and the transition tables as strings. It may use the event models
(the codec's output) and the state enums, nothing of the fold.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from ledger.domain.events import (
    DeliveryTransitioned,
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.states import DeliveryState, ExecutionState

Outcome = Literal["applied", "duplicate", "anomaly"]

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def avro_symbols(schema_file: str, enum_name: str) -> frozenset[str]:
    """The symbols of the enum ``enum_name`` declared in ``schemas/<schema_file>``."""
    found: list[list[str]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if node.get("type") == "enum" and node.get("name") == enum_name:
                found.append(list(node["symbols"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads((SCHEMAS / schema_file).read_text(encoding="utf-8")))
    assert len(found) == 1, f"{enum_name} is declared once in {schema_file}"
    return frozenset(found[0])


# --- the tables, from the seed and the schemas' docs --------------------------------------------

#: Execution: an intent is dispatched, or refused before any call (FAILED at attempt 0). A
#: dispatch ends SUCCEEDED, FAILED, or UNKNOWN when contact is lost. UNKNOWN is left only by
#: reconciliation: the provider says what happened, or policy permits a new attempt.
EXECUTION_NEXT: Mapping[str, frozenset[str]] = {
    "INTENT_RECORDED": frozenset({"DISPATCHED", "FAILED"}),
    "DISPATCHED": frozenset({"SUCCEEDED", "FAILED", "UNKNOWN"}),
    "UNKNOWN": frozenset({"SUCCEEDED", "FAILED", "DISPATCHED"}),
    "SUCCEEDED": frozenset(),
    "FAILED": frozenset(),
}
EXECUTION_FIRST = "INTENT_RECORDED"

#: Delivery: a pending delivery is sent or given up; a send is acknowledged, scheduled again
#: (the delivery is retried, never the execution) or given up; a given-up delivery is sent
#: again only by a person's redrive, which opens a new round.
DELIVERY_NEXT: Mapping[str, frozenset[str]] = {
    "PENDING": frozenset({"SENT", "DEAD_LETTERED"}),
    "SENT": frozenset({"ACKED", "PENDING", "DEAD_LETTERED"}),
    "ACKED": frozenset(),
    "DEAD_LETTERED": frozenset({"PENDING"}),
}
DELIVERY_FIRST = "PENDING"

_ALL_DECISIONS = avro_symbols("reconciliation_decided.avsc", "Decision")
#: Which decisions may be taken about an operation in each state: an intent whose owner went
#: away is resumed, refused, parked or cancelled; a dispatch in flight can only be cancelled
#: (what happened is learnt later); an UNKNOWN outcome gets every reconciliation decision but
#: RESUME (there is no intent left to resume); a finished execution takes none.
DECISIONS_IN: Mapping[str, frozenset[str]] = {
    "INTENT_RECORDED": frozenset({"RESUME", "REFUSE", "PARK", "CANCEL"}),
    "DISPATCHED": frozenset({"CANCEL"}),
    "UNKNOWN": _ALL_DECISIONS - {"RESUME"},
    "SUCCEEDED": frozenset(),
    "FAILED": frozenset(),
}
#: Decisions after which the operation waits for a person.
PARKS = frozenset({"PARK", "REFUSE"})

assert set(EXECUTION_NEXT) == avro_symbols("execution_transition.avsc", "ExecutionState")
assert set(DELIVERY_NEXT) == avro_symbols("delivery_transition.avsc", "DeliveryState")
assert set().union(*DECISIONS_IN.values()) == _ALL_DECISIONS


# --- the rows -----------------------------------------------------------------------------------


@dataclass
class Operation:
    """What ``agent_operations`` must hold for one operation."""

    operation_id: str
    tenant_id: str
    actor_id: str  # the intent's: the actor the operation is for
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
    version: int = 1
    #: (state symbol, attempt) -> event id of the event that recorded it
    seen: dict[tuple[str, int], str] = field(default_factory=dict)
    lease_token: int = 0
    #: (attempt, decision event id) a NEW_ATTEMPT decision permits, until that dispatch
    permit: tuple[int, str] | None = None
    parked: str | None = None
    cancelled: bool = False
    decision: str | None = None
    decided_at: datetime | None = None
    controls: set[str] = field(default_factory=set)


@dataclass
class Delivery:
    """What ``deliveries`` must hold for one (operation, destination)."""

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
    version: int = 1
    #: this round's (state symbol, attempt) -> event id
    seen: dict[tuple[str, int], str] = field(default_factory=dict)
    redrives: int = 0
    #: event ids of earlier rounds' steps
    retired: set[str] = field(default_factory=set)
    round_started_at: datetime | None = None


# --- the fold -----------------------------------------------------------------------------------


@dataclass
class IndependentFold:
    """Folds events one at a time, in log order; every execution-topic record must be folded
    before the delivery records (a delivery is judged against its execution as it ends)."""

    operations: dict[str, Operation] = field(default_factory=dict)
    deliveries: dict[tuple[str, str], Delivery] = field(default_factory=dict)

    def fold(self, event: OperationEvent) -> Outcome:
        if isinstance(event, ExecutionTransitioned):
            return self._execution(event)
        if isinstance(event, OwnershipTaken):
            return self._ownership(event)
        if isinstance(event, ReconciliationDecided):
            return self._decision(event)
        return self._delivery(event)

    # -- execution ------------------------------------------------------------------------------

    def _execution(self, e: ExecutionTransitioned) -> Outcome:
        op = self.operations.get(e.operation_id)
        state = e.state.value
        if op is None:
            if state != EXECUTION_FIRST:
                return "anomaly"  # a history starts with its intent
            self.operations[e.operation_id] = Operation(
                operation_id=e.operation_id,
                tenant_id=e.tenant_id,
                actor_id=e.actor_id,
                tool_name=e.tool_name,
                request_hash=e.request_hash,
                state=e.state,
                attempt=e.attempt,
                provider_ref=e.provider_ref,
                result_ref=e.result_ref,
                error=e.error,
                created_at=e.occurred_at,
                updated_at=e.occurred_at,
                state_entered_at=e.occurred_at,
                seen={(state, e.attempt): e.event_id},
                lease_token=e.lease_token or 0,
            )
            return "applied"
        # Who the operation belongs to and what it asks are fixed by its intent: anything else
        # is not a resend of one of its steps, whatever its event id.
        if e.tenant_id != op.tenant_id:
            return "anomaly"
        if (e.tool_name, e.request_hash) != (op.tool_name, op.request_hash):
            return "anomaly"
        recorded = op.seen.get((state, e.attempt))
        if recorded == e.event_id:
            return "duplicate"  # a resend: the same event again
        if recorded is not None:
            return "anomaly"  # another event for a step already recorded
        if (e.lease_token or 0) < op.lease_token:
            return "anomaly"  # fenced
        if state not in EXECUTION_NEXT[op.state.value]:
            return "anomaly"
        dispatch = state == "DISPATCHED"
        if e.attempt != (op.attempt + 1 if dispatch else op.attempt):
            return "anomaly"  # a dispatch adds one; every other step is about the current one
        new_attempt = dispatch and op.state.value == "UNKNOWN"
        if new_attempt and op.permit != (e.attempt, e.decision_id):
            return "anomaly"  # UNKNOWN is not permission to retry
        op.state = e.state
        op.attempt = e.attempt
        op.provider_ref = e.provider_ref if e.provider_ref else op.provider_ref
        op.result_ref = e.result_ref if e.result_ref else op.result_ref
        op.error = e.error
        op.updated_at = max(op.updated_at, e.occurred_at)
        op.state_entered_at = e.occurred_at
        op.version += 1
        op.seen[(state, e.attempt)] = e.event_id
        op.lease_token = max(op.lease_token, e.lease_token or 0)
        if new_attempt:
            op.permit = None  # used up
        op.parked = None  # the operation moved on
        return "applied"

    # -- ownership and decisions ----------------------------------------------------------------

    def _control(self, e: OwnershipTaken | ReconciliationDecided) -> Operation | Outcome:
        """The operation a control event may change, or the outcome that settles it."""
        op = self.operations.get(e.operation_id)
        if op is None or e.tenant_id != op.tenant_id:
            return "anomaly"
        if e.event_id in op.controls:
            return "duplicate"
        if not EXECUTION_NEXT[op.state.value]:
            return "anomaly"  # nothing is decided or owned after the execution finished
        return op

    def _controlled(self, op: Operation, e: OwnershipTaken | ReconciliationDecided) -> Outcome:
        op.updated_at = max(op.updated_at, e.occurred_at)
        op.version += 1
        op.controls.add(e.event_id)
        return "applied"

    def _ownership(self, e: OwnershipTaken) -> Outcome:
        op = self._control(e)
        if not isinstance(op, Operation):
            return op
        if e.lease_token <= op.lease_token:
            return "anomaly"  # a new owner's token is greater than every earlier one
        op.lease_token = e.lease_token
        return self._controlled(op, e)

    def _decision(self, e: ReconciliationDecided) -> Outcome:
        op = self._control(e)
        if not isinstance(op, Operation):
            return op
        if (e.lease_token or 0) < op.lease_token:
            return "anomaly"  # fenced
        if e.attempt != op.attempt:
            return "anomaly"  # a decision is about the current attempt
        decision = e.decision.value
        if decision not in DECISIONS_IN[op.state.value]:
            return "anomaly"
        op.lease_token = max(op.lease_token, e.lease_token or 0)
        op.decision, op.decided_at = decision, e.occurred_at
        if decision == "NEW_ATTEMPT":
            op.permit = (op.attempt + 1, e.event_id)
        elif decision in PARKS:
            op.parked = e.reason
        elif decision == "CANCEL":
            op.cancelled = True
        return self._controlled(op, e)

    # -- delivery -------------------------------------------------------------------------------

    def _delivery(self, e: DeliveryTransitioned) -> Outcome:
        # A delivery carries the result of a SUCCEEDED execution of the same tenant.
        execution = self.operations.get(e.operation_id)
        if execution is None or e.tenant_id != execution.tenant_id:
            return "anomaly"
        if execution.state.value != "SUCCEEDED" or execution.result_ref is None:
            return "anomaly"
        if e.result_ref is not None and e.result_ref != execution.result_ref:
            return "anomaly"
        key = (e.operation_id, e.destination)
        state = e.state.value
        d = self.deliveries.get(key)
        if d is None:
            if state != DELIVERY_FIRST or e.attempt != 0:
                return "anomaly"  # a delivery starts PENDING, before any send
            self.deliveries[key] = Delivery(
                operation_id=e.operation_id,
                destination=e.destination,
                tenant_id=e.tenant_id,
                actor_id=e.actor_id,
                state=e.state,
                attempts=0,
                result_ref=e.result_ref,
                next_attempt_at=e.next_attempt_at,
                error=e.error,
                created_at=e.occurred_at,
                updated_at=e.occurred_at,
                state_entered_at=e.occurred_at,
                seen={(state, e.attempt): e.event_id},
            )
            return "applied"
        if e.event_id in d.retired:
            return "duplicate"  # a late resend of an earlier round's step
        redrive = d.state.value == "DEAD_LETTERED" and state == "PENDING"
        recorded = d.seen.get((state, e.attempt))
        if recorded == e.event_id:
            return "duplicate"
        if recorded is not None and not redrive:
            return "anomaly"  # another event for a step of this round
        if state not in DELIVERY_NEXT[d.state.value]:
            return "anomaly"
        if redrive and not e.error:
            return "anomaly"  # a person says why they send it again
        if e.attempt != (d.attempts + 1 if state == "SENT" else d.attempts):
            return "anomaly"  # a send adds one; every other step is about the last send
        if redrive:
            d.retired |= set(d.seen.values())
            d.seen = {}
            d.redrives += 1
            d.round_started_at = e.occurred_at
        d.seen[(state, e.attempt)] = e.event_id
        d.state = e.state
        d.attempts = e.attempt
        d.result_ref = e.result_ref if e.result_ref else d.result_ref
        d.next_attempt_at = e.next_attempt_at if state == "PENDING" else None
        d.error = e.error
        d.updated_at = max(d.updated_at, e.occurred_at)
        d.state_entered_at = e.occurred_at
        d.version += 1
        return "applied"


# --- the rows, as the projection stores them ----------------------------------------------------


def _seen(seen: Mapping[tuple[str, int], str]) -> list[str]:
    # ``seen`` is stored as "STATE:attempt:event_id" strings, sorted.
    return sorted(f"{s}:{a}:{e}" for (s, a), e in seen.items())


def operation_row(r: Operation) -> tuple[object, ...]:
    """The ``agent_operations`` row (``assert_projection_matches`` selects these columns)."""
    return (
        r.operation_id,
        r.tenant_id,
        r.actor_id,
        r.tool_name,
        r.request_hash,
        str(r.state),
        r.attempt,
        r.provider_ref,
        r.result_ref,
        r.error,
        r.created_at,
        r.updated_at,
        r.state_entered_at,
        r.version,
        _seen({(str(s), a): e for (s, a), e in r.seen.items()}),
        r.lease_token,
        None if r.permit is None else r.permit[0],
        None if r.permit is None else r.permit[1],
        r.parked,
        r.cancelled,
        None if r.decision is None else str(r.decision),
        r.decided_at,
        sorted(r.controls),
    )


def delivery_row(r: Delivery) -> tuple[object, ...]:
    """The ``deliveries`` row (``assert_projection_matches`` selects these columns)."""
    return (
        r.operation_id,
        r.destination,
        r.tenant_id,
        r.actor_id,
        str(r.state),
        r.attempts,
        r.result_ref,
        r.next_attempt_at,
        r.error,
        r.created_at,
        r.updated_at,
        r.state_entered_at,
        r.version,
        _seen({(str(s), a): e for (s, a), e in r.seen.items()}),
        r.redrives,
        sorted(r.retired),
        r.round_started_at,
    )

"""The projection rows of the two records, to and from their domain form.

``projections`` writes these rows; the SDK (``load``) and the recovery worker read them back to
resume an operation. Both sides convert here, so a column and its field can never drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ledger.domain.fold import UNKNOWN_EVENT, DeliveryRecord, ExecutionRecord
from ledger.domain.reconcile import Decision
from ledger.domain.states import DeliveryState, ExecutionState

#: agent_operations columns that hold an ExecutionRecord (kafka_partition is the writer's own).
OP_COLUMNS = (
    "operation_id",
    "tenant_id",
    "actor_id",
    "tool_name",
    "request_hash",
    "execution_state",
    "attempt",
    "provider_ref",
    "result_ref",
    "error",
    "created_at",
    "updated_at",
    "state_entered_at",
    "version",
    "seen",
    "lease_token",
    "permit_attempt",
    "permit_decision",
    "parked",
    "cancelled",
    "decision",
    "decided_at",
    "controls",
)
DELIVERY_COLUMNS = (
    "operation_id",
    "destination",
    "tenant_id",
    "actor_id",
    "state",
    "attempts",
    "result_ref",
    "next_attempt_at",
    "error",
    "created_at",
    "updated_at",
    "state_entered_at",
    "version",
    "seen",
    "redrives",
    "retired",
    "round_started_at",
)


def seen_text(seen: Mapping[Any, str]) -> list[str]:
    """``STATE:attempt:event_id`` per recorded transition (``STATE:attempt`` when unknown)."""
    return sorted(
        f"{state}:{attempt}:{event_id}" if event_id else f"{state}:{attempt}"
        for (state, attempt), event_id in seen.items()
    )


def _parse_seen(values: Sequence[str], state_type: Any) -> Mapping[Any, str]:
    seen: dict[Any, str] = {}
    for value in values:
        parts = value.split(":")
        # Rows written before event ids were kept have no third part.
        event_id = parts[2] if len(parts) > 2 else UNKNOWN_EVENT
        seen[(state_type(parts[0]), int(parts[1]))] = event_id
    return MappingProxyType(seen)


# ``state._value_`` rather than ``state.value``: the same string, read as a plain attribute
# instead of through the enum's property (one of these per event and per changed row).


def execution_row(r: ExecutionRecord) -> tuple[Any, ...]:
    permit_attempt, permit_decision = r.permit if r.permit is not None else (None, None)
    return (
        r.operation_id,
        r.tenant_id,
        r.actor_id,
        r.tool_name,
        r.request_hash,
        r.state._value_,
        r.attempt,
        r.provider_ref,
        r.result_ref,
        r.error,
        r.created_at,
        r.updated_at,
        r.state_entered_at,
        r.version,
        seen_text(r.seen),
        r.lease_token,
        permit_attempt,
        permit_decision,
        r.parked,
        r.cancelled,
        None if r.decision is None else r.decision._value_,
        r.decided_at,
        sorted(r.controls),
    )


def execution_from_row(row: Sequence[Any]) -> ExecutionRecord:
    """An ExecutionRecord from a row selected with :data:`OP_COLUMNS`, in that order."""
    (
        op,
        tenant,
        actor,
        tool,
        rhash,
        state,
        attempt,
        pref,
        rref,
        err,
        created,
        updated,
        entered,
        version,
        seen,
        lease_token,
        permit_attempt,
        permit_decision,
        parked,
        cancelled,
        decision,
        decided_at,
        controls,
    ) = row
    return ExecutionRecord(
        operation_id=op,
        tenant_id=tenant,
        actor_id=actor,
        tool_name=tool,
        request_hash=rhash,
        state=ExecutionState(state),
        attempt=attempt,
        provider_ref=pref,
        result_ref=rref,
        error=err,
        created_at=created,
        updated_at=updated,
        state_entered_at=entered,
        version=version,
        seen=_parse_seen(seen, ExecutionState),
        lease_token=lease_token,
        permit=None if permit_attempt is None else (permit_attempt, permit_decision),
        parked=parked,
        cancelled=cancelled,
        decision=None if decision is None else Decision(decision),
        decided_at=decided_at,
        controls=frozenset(controls),
    )


def delivery_row(r: DeliveryRecord) -> tuple[Any, ...]:
    return (
        r.operation_id,
        r.destination,
        r.tenant_id,
        r.actor_id,
        r.state._value_,
        r.attempts,
        r.result_ref,
        r.next_attempt_at,
        r.error,
        r.created_at,
        r.updated_at,
        r.state_entered_at,
        r.version,
        seen_text(r.seen),
        r.redrives,
        sorted(r.retired),
        r.round_started_at,
    )


def delivery_from_row(row: Sequence[Any]) -> DeliveryRecord:
    """A DeliveryRecord from a row selected with :data:`DELIVERY_COLUMNS`, in that order."""
    (
        op,
        dest,
        tenant,
        actor,
        state,
        attempts,
        rref,
        nxt,
        err,
        created,
        updated,
        entered,
        version,
        seen,
        redrives,
        retired,
        round_started_at,
    ) = row
    return DeliveryRecord(
        operation_id=op,
        destination=dest,
        tenant_id=tenant,
        actor_id=actor,
        state=DeliveryState(state),
        attempts=attempts,
        result_ref=rref,
        next_attempt_at=nxt,
        error=err,
        created_at=created,
        updated_at=updated,
        state_entered_at=entered,
        version=version,
        seen=_parse_seen(seen, DeliveryState),
        redrives=redrives,
        retired=frozenset(retired),
        round_started_at=round_started_at,
    )


def columns(names: Iterable[str]) -> str:
    """Quoted, comma-separated column names for SQL text."""
    return ", ".join(f'"{c}"' for c in names)

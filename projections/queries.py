"""Analyst queries over the projection tables: plain functions over a psycopg connection.

Every read is scoped to tenants: ``tenant_id`` (or ``tenant_ids``) is a required argument and
appears in every ``WHERE``, so no caller can see another tenant's operations by forgetting a
filter. The SQL lives in module-level constants so the README can quote it for analysts who use
``psql`` directly; each takes named parameters (``%(tenant_id)s``) that psql users substitute.
Optional filters are written as ``(%(x)s IS NULL OR column = %(x)s)``, so one statement serves
every combination and stays readable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ledger.domain.names import InvalidNameError, NameKind, check_name
from ledger.domain.states import DeliveryState, ExecutionState

#: Largest ``limit`` accepted by :func:`list_operations`; bigger exports belong in psql.
MAX_LIMIT = 10_000


class QueryError(ValueError):
    """An argument cannot match anything that was recorded (bad id, state, limit...)."""


# -- SQL ------------------------------------------------------------------------------------------

#: Operations of one tenant, oldest state change first: "what has been stuck longest?".
#: ``older_than`` is an interval; ``now`` defaults to the database clock (tests pin it).
LIST_OPERATIONS_SQL = """
SELECT operation_id, tenant_id, actor_id, tool_name, execution_state, attempt,
       provider_ref, result_ref, error, created_at, updated_at, state_entered_at
  FROM agent_operations
 WHERE tenant_id = %(tenant_id)s
   AND (%(state)s::text IS NULL OR execution_state = %(state)s::text)
   AND (%(tool)s::text IS NULL OR tool_name = %(tool)s::text)
   AND (%(older_than)s::interval IS NULL
        OR state_entered_at < COALESCE(%(now)s::timestamptz, now()) - %(older_than)s::interval)
 ORDER BY state_entered_at, operation_id
 LIMIT %(limit)s
"""

#: The current execution row of one operation (none if the operation is another tenant's).
SHOW_OPERATION_SQL = """
SELECT operation_id, tenant_id, actor_id, tool_name, execution_state, attempt,
       provider_ref, result_ref, error, created_at, updated_at, state_entered_at
  FROM agent_operations
 WHERE tenant_id = %(tenant_id)s AND operation_id = %(operation_id)s
"""

#: Its delivery rows, one per destination.
SHOW_DELIVERIES_SQL = """
SELECT operation_id, destination, state, attempts, result_ref, next_attempt_at, error,
       created_at, updated_at, state_entered_at
  FROM deliveries
 WHERE tenant_id = %(tenant_id)s AND operation_id = %(operation_id)s
 ORDER BY destination
"""

#: Every event consumed for it - applied, duplicate or anomaly - with its Kafka coordinates, in
#: the order the events happened (coordinates break ties, so the order is stable).
SHOW_HISTORY_SQL = """
SELECT occurred_at, topic, partition, "offset", event_id, actor_id, machine, destination,
       state, attempt, outcome, provider_ref, result_ref, error
  FROM operation_history
 WHERE tenant_id = %(tenant_id)s AND operation_id = %(operation_id)s
 ORDER BY occurred_at, topic, partition, "offset"
"""

#: Its reconciliation decisions, in the order they were taken: what the provider lookup said,
#: the policy version that decided (with the grant or revocation it names and who made it) and
#: whether policy allowed going on. The policy record is looked up within the same tenant only.
SHOW_RECONCILIATIONS_SQL = """
SELECT r.occurred_at, r.topic, r.partition, r."offset", r.event_id, r.actor_id, r.attempt,
       r.decision, r.lookup, r.provider_ref, r.result_ref, r.policy_version, r.policy_allowed,
       r.lease_token, r.reason,
       p.change AS policy_change, p.actor_id AS policy_changed_by, p.reason AS policy_reason
  FROM reconciliations r
  LEFT JOIN LATERAL (
        SELECT h.change, h.actor_id, h.reason
          FROM policy_history h
         WHERE h.tenant_id = r.tenant_id AND h.event_id = r.policy_version
         ORDER BY h.topic, h.partition, h."offset"
         LIMIT 1
       ) p ON TRUE
 WHERE r.tenant_id = %(tenant_id)s AND r.operation_id = %(operation_id)s
 ORDER BY r.occurred_at, r.topic, r.partition, r."offset"
"""

#: Refused events aimed at it, with the fold's reason: scoped by the operation's owner, so the
#: owner also sees what another tenant tried on its operation (the reason never names that
#: tenant; ``anomalies.source_tenant_id`` keeps it for operators).
SHOW_ANOMALIES_SQL = """
SELECT topic, partition, "offset", machine, kind, reason, detected_at
  FROM anomalies
 WHERE tenant_id = %(tenant_id)s AND operation_id = %(operation_id)s
 ORDER BY topic, partition, "offset"
"""

#: Executions by state per tenant, with the oldest time a state was entered. ``since`` (NULL for
#: all time) keeps only operations created from then on.
SUMMARY_EXECUTIONS_SQL = """
SELECT tenant_id, execution_state, count(*) AS operations,
       min(state_entered_at) AS oldest_state_entered_at
  FROM agent_operations
 WHERE tenant_id = ANY(%(tenant_ids)s)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
 GROUP BY tenant_id, execution_state
 ORDER BY tenant_id, execution_state
"""

#: Deliveries by destination x state per tenant, with the sends they took.
SUMMARY_DELIVERIES_SQL = """
SELECT tenant_id, destination, state, count(*) AS deliveries, sum(attempts) AS attempts,
       max(attempts) AS max_attempts
  FROM deliveries
 WHERE tenant_id = ANY(%(tenant_ids)s)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
 GROUP BY tenant_id, destination, state
 ORDER BY tenant_id, destination, state
"""

#: Repeated appends recognised by the fold (a service retrying its own call), per tenant and
#: state machine. Counted, never applied twice.
SUMMARY_DUPLICATES_SQL = """
SELECT tenant_id, machine, count(*) AS duplicates
  FROM operation_history
 WHERE tenant_id = ANY(%(tenant_ids)s) AND outcome = 'duplicate'
   AND (%(since)s::timestamptz IS NULL OR occurred_at >= %(since)s::timestamptz)
 GROUP BY tenant_id, machine
 ORDER BY tenant_id, machine
"""

#: Illegal transitions per tenant and state machine.
SUMMARY_ANOMALIES_SQL = """
SELECT tenant_id, machine, count(*) AS anomalies
  FROM anomalies
 WHERE tenant_id = ANY(%(tenant_ids)s)
   AND (%(since)s::timestamptz IS NULL OR detected_at >= %(since)s::timestamptz)
 GROUP BY tenant_id, machine
 ORDER BY tenant_id, machine
"""

#: The age of the oldest operation awaiting reconciliation (UNKNOWN) per tenant: the number to
#: alert on, since UNKNOWN must never be retried blindly and only reconciliation moves it.
SUMMARY_OLDEST_UNKNOWN_SQL = """
SELECT tenant_id, COALESCE(%(now)s::timestamptz, now()) - min(state_entered_at) AS age
  FROM agent_operations
 WHERE tenant_id = ANY(%(tenant_ids)s) AND execution_state = 'UNKNOWN'
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
 GROUP BY tenant_id
 ORDER BY tenant_id
"""


# -- results --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OperationRow:
    """The current execution of one operation (``agent_operations``)."""

    operation_id: str
    tenant_id: str
    actor_id: str
    tool_name: str
    execution_state: ExecutionState
    attempt: int
    provider_ref: str | None
    result_ref: str | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    state_entered_at: datetime


@dataclass(frozen=True, slots=True)
class DeliveryRow:
    """The current delivery of one operation's result to one destination (``deliveries``)."""

    operation_id: str
    destination: str
    state: DeliveryState
    attempts: int
    result_ref: str | None
    next_attempt_at: datetime | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    state_entered_at: datetime


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One consumed event and what the fold made of it (``operation_history``)."""

    occurred_at: datetime
    topic: str
    partition: int
    offset: int
    event_id: str
    actor_id: str
    machine: str
    destination: str | None
    state: str
    attempt: int
    outcome: str
    provider_ref: str | None
    result_ref: str | None
    error: str | None


@dataclass(frozen=True, slots=True)
class ReconciliationRow:
    """A reconciliation decision about one operation (``reconciliations``), with the policy
    record it cites (``policy_history``; None when no grant matched or it is not projected)."""

    occurred_at: datetime
    topic: str
    partition: int
    offset: int
    event_id: str
    #: who decided: the recovery worker's identity, or the person who cancelled
    actor_id: str
    attempt: int
    decision: str
    lookup: str
    provider_ref: str | None
    result_ref: str | None
    policy_version: str | None
    policy_allowed: bool
    lease_token: int | None
    reason: str
    #: GRANT, REVOKE or REVOKE_CREDENTIAL: what the cited policy record did
    policy_change: str | None
    #: who granted or revoked it
    policy_changed_by: str | None
    policy_reason: str | None


@dataclass(frozen=True, slots=True)
class AnomalyRow:
    """An illegal transition, never applied (``anomalies``)."""

    topic: str
    partition: int
    offset: int
    machine: str
    kind: str
    reason: str
    detected_at: datetime


@dataclass(frozen=True, slots=True)
class OperationDetail:
    """Everything one tenant may see about one operation."""

    operation: OperationRow | None
    deliveries: list[DeliveryRow]
    reconciliations: list[ReconciliationRow]
    history: list[HistoryRow]
    anomalies: list[AnomalyRow]


@dataclass(frozen=True, slots=True)
class Summary:
    """Counts per tenant; every mapping is keyed by tenant first."""

    #: tenant -> execution state -> operations
    executions: dict[str, dict[ExecutionState, int]]
    #: tenant -> (destination, delivery state) -> (deliveries, sends, most sends of one)
    deliveries: dict[str, dict[tuple[str, DeliveryState], tuple[int, int, int]]]
    #: tenant -> machine ("execution" | "delivery") -> repeated appends recognised
    duplicates: dict[str, dict[str, int]]
    #: tenant -> machine -> illegal transitions recorded
    anomalies: dict[str, dict[str, int]]
    #: tenant -> age of its oldest UNKNOWN operation (tenants with none are absent)
    oldest_unknown: dict[str, timedelta]


# -- validation -----------------------------------------------------------------------------------


def _checked(kind: NameKind, value: object) -> str:
    # Anything but a name an event could carry cannot have been recorded: a typo worth
    # reporting rather than an empty answer.
    try:
        return check_name(kind, value)
    except InvalidNameError as exc:
        raise QueryError(str(exc)) from None


def check_tenant(tenant_id: str) -> str:
    """``tenant_id`` if it is an identifier an event could carry, else QueryError."""
    return _checked(NameKind.TENANT, tenant_id)


def check_operation_id(operation_id: str) -> str:
    """``operation_id`` if it has the ``op_`` + ULID shape, else QueryError."""
    return _checked(NameKind.OPERATION_ID, operation_id)


def parse_state(state: ExecutionState | str) -> ExecutionState:
    """The ExecutionState named by ``state`` (a symbol such as ``UNKNOWN``), else QueryError."""
    if isinstance(state, ExecutionState):
        return state
    try:
        return ExecutionState(state)
    except ValueError:
        symbols = ", ".join(s.value for s in ExecutionState)
        raise QueryError(f"not an execution state: {state!r} (one of {symbols})") from None


def _check_tool(tool: str) -> str:
    return _checked(NameKind.TOOL, tool)


# -- queries --------------------------------------------------------------------------------------


def list_operations(
    conn: psycopg.Connection[Any],
    tenant_id: str,
    *,
    state: ExecutionState | str | None = None,
    tool: str | None = None,
    older_than: timedelta | None = None,
    limit: int = 50,
    now: datetime | None = None,
) -> list[OperationRow]:
    """Operations of ``tenant_id``, oldest state change first.

    ``older_than`` keeps operations whose current state was entered longer ago than that
    (relative to ``now``, the database clock by default).
    """
    if older_than is not None and older_than <= timedelta(0):
        raise QueryError(f"older_than must be positive, got {older_than}")
    if not 1 <= limit <= MAX_LIMIT:
        raise QueryError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    params = {
        "tenant_id": check_tenant(tenant_id),
        "state": None if state is None else parse_state(state).value,
        "tool": None if tool is None else _check_tool(tool),
        "older_than": older_than,
        "now": now,
        "limit": limit,
    }
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(LIST_OPERATIONS_SQL, params).fetchall()
    return [_operation(row) for row in rows]


def show_operation(
    conn: psycopg.Connection[Any], tenant_id: str, operation_id: str
) -> OperationDetail | None:
    """Everything ``tenant_id`` may see about ``operation_id``; None if it saw nothing of it.

    Another tenant's operation is None here, exactly as if it did not exist.
    """
    params = {
        "tenant_id": check_tenant(tenant_id),
        "operation_id": check_operation_id(operation_id),
    }
    with conn.cursor(row_factory=dict_row) as cur:
        op_row = cur.execute(SHOW_OPERATION_SQL, params).fetchone()
        deliveries = [_delivery(r) for r in cur.execute(SHOW_DELIVERIES_SQL, params).fetchall()]
        decisions = [
            ReconciliationRow(**r) for r in cur.execute(SHOW_RECONCILIATIONS_SQL, params).fetchall()
        ]
        history = [HistoryRow(**r) for r in cur.execute(SHOW_HISTORY_SQL, params).fetchall()]
        anomalies = [AnomalyRow(**r) for r in cur.execute(SHOW_ANOMALIES_SQL, params).fetchall()]
    if op_row is None and not deliveries and not decisions and not history and not anomalies:
        return None
    return OperationDetail(
        operation=None if op_row is None else _operation(op_row),
        deliveries=deliveries,
        reconciliations=decisions,
        history=history,
        anomalies=anomalies,
    )


def summary(
    conn: psycopg.Connection[Any],
    tenant_ids: Sequence[str],
    *,
    since: datetime | None = None,
    now: datetime | None = None,
) -> Summary:
    """Counts for each of ``tenant_ids``: executions by state, deliveries by destination x state,
    duplicates, anomalies and the oldest UNKNOWN's age.

    ``since`` keeps only operations created (events occurred, anomalies detected) from then on;
    the demo uses it to report on its own run.
    """
    if not tenant_ids:
        raise QueryError("summary needs at least one tenant id")
    params = {
        "tenant_ids": [check_tenant(t) for t in tenant_ids],
        "since": since,
        "now": now,
    }
    result = Summary({}, {}, {}, {}, {})
    with conn.cursor() as cur:
        for tenant, state, count, _oldest in cur.execute(SUMMARY_EXECUTIONS_SQL, params):
            result.executions.setdefault(tenant, {})[ExecutionState(state)] = count
        for tenant, dest, state, count, attempts, most in cur.execute(
            SUMMARY_DELIVERIES_SQL, params
        ):
            key = (dest, DeliveryState(state))
            result.deliveries.setdefault(tenant, {})[key] = (count, int(attempts), most)
        for tenant, machine, count in cur.execute(SUMMARY_DUPLICATES_SQL, params):
            result.duplicates.setdefault(tenant, {})[machine] = count
        for tenant, machine, count in cur.execute(SUMMARY_ANOMALIES_SQL, params):
            result.anomalies.setdefault(tenant, {})[machine] = count
        for tenant, age in cur.execute(SUMMARY_OLDEST_UNKNOWN_SQL, params):
            result.oldest_unknown[tenant] = age
    return result


def _operation(row: dict[str, Any]) -> OperationRow:
    return OperationRow(**{**row, "execution_state": ExecutionState(row["execution_state"])})


def _delivery(row: dict[str, Any]) -> DeliveryRow:
    return DeliveryRow(**{**row, "state": DeliveryState(row["state"])})

"""Two tenants try every transition of both state machines on each other's operations, through
a raw producer (the SDK refuses them before they are sent; a foreign writer need not use it).
Nothing is applied, the owner's rows stay exactly as they were, and each attempt is an anomaly the
*owner* can see, whose reason names no tenant; who sent it is kept for operators only."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition
from ledger.domain.ids import content_ref, event_id
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.settings import Settings
from producers import IllegalTransitionError, TrackedOperation, TransitionRecorder
from projections import queries
from tests.support import produce, project_in_process

X, D = ExecutionState, DeliveryState
TENANTS = ("acme", "globex")
DESTINATIONS = ("webhook:crm", "queue:billing")


def _owned_operations(recorder: TransitionRecorder, tenant: str) -> list[TrackedOperation]:
    """One operation of ``tenant`` in each execution state, the SUCCEEDED ones with deliveries
    in every delivery state."""
    ops = []

    def new() -> TrackedOperation:
        op = recorder.intent(tenant, f"{tenant}-agent", "send_email", {"to": f"{tenant}@x"})
        ops.append(op)
        return op

    new()  # INTENT_RECORDED
    recorder.dispatched(new(), provider_ref="p")  # DISPATCHED
    op = new()
    recorder.dispatched(op, provider_ref="p")
    recorder.unknown(op, "connection reset")
    op = new()
    recorder.dispatched(op, provider_ref="p")
    recorder.failed(op, "HTTP 422")
    for final in (D.PENDING, D.SENT, D.ACKED, D.DEAD_LETTERED):
        op = new()
        recorder.dispatched(op, provider_ref="p")
        recorder.succeeded(op, f"result {tenant} {final}".encode())
        for destination in DESTINATIONS:
            recorder.delivery_pending(op, destination)
            if final is D.PENDING:
                continue
            recorder.delivery_sent(op, destination)
            if final is D.ACKED:
                recorder.delivery_acked(op, destination)
            elif final is D.DEAD_LETTERED:
                recorder.delivery_dead_lettered(op, destination, "gave up")
    return ops


def _attacks(victim: TrackedOperation, attacker: str) -> list[Transition]:
    """Every (state, attempt) of both machines, written as ``attacker`` on ``victim``'s op."""
    execution = victim.require_execution()
    common: dict[str, Any] = {
        "operation_id": victim.operation_id,
        "tenant_id": attacker,
        "actor_id": f"{attacker}-agent",
        "occurred_at": execution.updated_at,
    }
    out: list[Transition] = []
    for n, (state, attempt) in enumerate(
        [(X.INTENT_RECORDED, 0), (X.FAILED, 0)]
        + [(s, a) for s in (X.DISPATCHED, X.SUCCEEDED, X.FAILED, X.UNKNOWN) for a in (1, 2)]
    ):
        extra: dict[str, Any] = {}
        if state is X.SUCCEEDED:
            extra["result_ref"] = content_ref(b"forged")
        if state in (X.FAILED, X.UNKNOWN):
            extra["error"] = "forged"
        out.append(
            ExecutionTransitioned(
                event_id=event_id(1_700_000_000_000 + n, victim.operation_id[-10:].encode()),
                attempt=attempt,
                state=state,
                tool_name=execution.tool_name,
                request_hash=execution.request_hash,
                **common,
                **extra,
            )
        )
    deliveries = [(D.PENDING, 0), (D.SENT, 1), (D.ACKED, 1), (D.PENDING, 1), (D.DEAD_LETTERED, 1)]
    for m, (state, attempt) in enumerate(deliveries * 2):
        destination = DESTINATIONS[0] if m < len(deliveries) else "webhook:attacker"
        out.append(
            DeliveryTransitioned(
                event_id=event_id(1_700_000_100_000 + m, victim.operation_id[-10:].encode()),
                attempt=attempt,
                destination=destination,
                state=state,
                error="forged" if state is D.DEAD_LETTERED else None,
                **common,
            )
        )
    return out


def _rows(conn: psycopg.Connection[Any], tenant: str) -> tuple[list[Any], list[Any]]:
    ops = conn.execute(
        "SELECT * FROM agent_operations WHERE tenant_id = %s ORDER BY operation_id", (tenant,)
    ).fetchall()
    deliveries = conn.execute(
        "SELECT * FROM deliveries WHERE tenant_id = %s ORDER BY operation_id, destination",
        (tenant,),
    ).fetchall()
    return ops, deliveries


def test_tenants_cannot_touch_each_others_operations(isolated: Settings) -> None:
    with TransitionRecorder.connect(isolated) as recorder:
        owned = {tenant: _owned_operations(recorder, tenant) for tenant in TENANTS}
        # Through the SDK an attacker has no handle on the victim's operation: a delivery event
        # folds onto an empty history and is refused before anything is sent.
        victim = owned["acme"][-1]
        forged_delivery = next(
            e for e in _attacks(victim, "globex") if isinstance(e, DeliveryTransitioned)
        )
        with pytest.raises(IllegalTransitionError):
            recorder.append([forged_delivery])
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        before = {tenant: _rows(conn, tenant) for tenant in TENANTS}

    attacks: dict[str, list[Transition]] = {}
    for attacker, owner in (("globex", "acme"), ("acme", "globex")):
        attacks[owner] = [e for victim in owned[owner] for e in _attacks(victim, attacker)]
        produce(isolated, attacks[owner])
    project_in_process(isolated)

    with psycopg.connect(isolated.dsn) as conn:
        for owner in TENANTS:
            attacker = next(t for t in TENANTS if t != owner)
            assert _rows(conn, owner) == before[owner], f"{attacker} changed {owner}'s rows"
            anomalies = conn.execute(
                "SELECT operation_id, kind, reason, source_tenant_id FROM anomalies "
                "WHERE tenant_id = %s",
                (owner,),
            ).fetchall()
            assert len(anomalies) == len(attacks[owner]), "every attempt is an anomaly"
            for _op, kind, reason, source in anomalies:
                assert kind == "foreign_tenant"
                assert source == attacker, "operators see who sent it"
                assert attacker not in reason and owner not in reason
            applied = conn.execute(
                "SELECT count(*) FROM operation_history WHERE tenant_id = %s "
                "AND outcome = 'applied' AND operation_id = ANY(%s)",
                (attacker, [op.operation_id for op in owned[owner]]),
            ).fetchone()
            assert applied == (0,)
            for victim in owned[owner]:
                mine = queries.show_operation(conn, owner, victim.operation_id)
                assert mine is not None and mine.operation is not None
                assert len(mine.anomalies) == len(_attacks(victim, attacker))
                assert all(attacker not in a.reason for a in mine.anomalies)
                theirs = queries.show_operation(conn, attacker, victim.operation_id)
                # The attacker sees only its own refused events: no operation, no deliveries,
                # no anomalies (those belong to the owner).
                assert theirs is not None
                assert theirs.operation is None and theirs.deliveries == []
                assert theirs.anomalies == []
                assert {h.outcome for h in theirs.history} == {"anomaly"}

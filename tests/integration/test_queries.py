"""The analyst queries against real projections: what they return equals the independent fold for
that tenant, and no tenant can see another tenant's operations."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from ledger.domain.events import ExecutionTransitioned, Transition
from ledger.domain.ids import content_ref, event_id
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.settings import Settings
from opledger.workload import Workload
from projections import queries
from tests.independent_fold import Operation
from tests.support import Expected, env_for, independent_fold, produce, project_in_process

ROOT = Path(__file__).resolve().parents[2]
TENANT = "acme"


@pytest.fixture(scope="module")
def projected(module_isolated: Settings) -> tuple[Settings, list[Transition], Expected, str]:
    """300 operations across three tenants, one illegal event for an acme operation, projected
    once for the module (its tests only read).

    Returns the settings, every event produced, the independent fold and the operation id that
    received the illegal event.
    """
    events = [e for op in Workload(seed=21).operations(300) for e in op]
    target = next(
        e for e in events if isinstance(e, ExecutionTransitioned) and e.tenant_id == TENANT
    )
    last = max(e.occurred_at for e in events)
    illegal = ExecutionTransitioned(
        event_id=event_id(1, b"\x09" * 10),
        operation_id=target.operation_id,
        tenant_id=TENANT,
        actor_id=target.actor_id,
        occurred_at=last + timedelta(seconds=1),
        attempt=7,  # no operation of the workload reaches attempt 7: always an anomaly
        state=ExecutionState.SUCCEEDED,
        tool_name=target.tool_name,
        request_hash=target.request_hash,
        result_ref=content_ref(b"forged"),
    )
    events.append(illegal)
    produce(module_isolated, events)
    project_in_process(module_isolated)
    return module_isolated, events, independent_fold(module_isolated), target.operation_id


def _tenant_ops(expected: Expected, tenant: str) -> list[Operation]:
    ops = [r for r in expected.operations.values() if r.tenant_id == tenant]
    return sorted(ops, key=lambda r: (r.state_entered_at, r.operation_id))


def _as_tuple(row: queries.OperationRow) -> tuple[object, ...]:
    return (
        row.operation_id,
        row.tenant_id,
        row.actor_id,
        row.tool_name,
        row.execution_state,
        row.attempt,
        row.provider_ref,
        row.result_ref,
        row.error,
        row.created_at,
        row.updated_at,
        row.state_entered_at,
    )


def _record_tuple(r: Operation) -> tuple[object, ...]:
    return (
        r.operation_id,
        r.tenant_id,
        r.actor_id,
        r.tool_name,
        r.state,
        r.attempt,
        r.provider_ref,
        r.result_ref,
        r.error,
        r.created_at,
        r.updated_at,
        r.state_entered_at,
    )


def test_list_operations_equals_the_fold_for_the_tenant(
    projected: tuple[Settings, list[Transition], Expected, str],
) -> None:
    settings, _events, expected, _ = projected
    want = _tenant_ops(expected, TENANT)
    assert len(want) > 50
    with psycopg.connect(settings.dsn) as conn:
        rows = queries.list_operations(conn, TENANT, limit=10_000)
        assert [_as_tuple(r) for r in rows] == [_record_tuple(r) for r in want]

        unknown = queries.list_operations(conn, TENANT, state="UNKNOWN", limit=10_000)
        assert [r.operation_id for r in unknown] == [
            r.operation_id for r in want if r.state is ExecutionState.UNKNOWN
        ]
        assert unknown, "the workload leaves some operations awaiting reconciliation"

        tool = want[0].tool_name
        by_tool = queries.list_operations(conn, TENANT, tool=tool, limit=10_000)
        assert [r.operation_id for r in by_tool] == [
            r.operation_id for r in want if r.tool_name == tool
        ]

        # "Entered its state more than an hour before `now`", with `now` pinned so the
        # cut falls in the middle of the workload.
        cut = want[len(want) // 2].state_entered_at
        older = queries.list_operations(
            conn, TENANT, older_than=timedelta(hours=1), limit=10_000, now=cut + timedelta(hours=1)
        )
        assert [r.operation_id for r in older] == [
            r.operation_id for r in want if r.state_entered_at < cut
        ]

        limited = queries.list_operations(conn, TENANT, limit=5)
        assert [r.operation_id for r in limited] == [r.operation_id for r in want[:5]]


def test_show_operation_has_rows_history_and_anomalies(
    projected: tuple[Settings, list[Transition], Expected, str],
) -> None:
    settings, events, expected, anomalous = projected
    delivered = next(
        r
        for r in _tenant_ops(expected, TENANT)
        if (r.operation_id, "webhook:crm") in expected.deliveries
    )
    with psycopg.connect(settings.dsn) as conn:
        detail = queries.show_operation(conn, TENANT, delivered.operation_id)
        with_anomaly = queries.show_operation(conn, TENANT, anomalous)
    assert detail is not None and detail.operation is not None
    assert _as_tuple(detail.operation) == _record_tuple(delivered)
    want_deliveries = sorted(
        (d for (op, _), d in expected.deliveries.items() if op == delivered.operation_id),
        key=lambda d: d.destination,
    )
    assert [
        (d.destination, d.state, d.attempts, d.next_attempt_at, d.error) for d in detail.deliveries
    ] == [(d.destination, d.state, d.attempts, d.next_attempt_at, d.error) for d in want_deliveries]
    # The history is every event of the operation (repeated appends included), in the order
    # they happened, each with where it sits in Kafka.
    mine = [e for e in events if e.operation_id == delivered.operation_id]
    assert [(h.state, h.attempt, h.event_id) for h in detail.history] == [
        (str(e.state), e.attempt, e.event_id) for e in mine
    ]
    for h in detail.history:
        assert expected.outcomes[(h.topic, h.partition, h.offset)] == h.outcome
    assert detail.anomalies == []

    assert with_anomaly is not None
    assert len(with_anomaly.anomalies) == 1
    assert "attempt" in with_anomaly.anomalies[0].reason
    assert with_anomaly.history[-1].outcome == "anomaly"
    assert with_anomaly.history[-1].attempt == 7


def test_another_tenants_operation_is_invisible(
    projected: tuple[Settings, list[Transition], Expected, str],
) -> None:
    settings, _events, expected, _ = projected
    theirs = _tenant_ops(expected, "globex")
    assert theirs
    with psycopg.connect(settings.dsn) as conn:
        for record in theirs[:20]:
            assert queries.show_operation(conn, TENANT, record.operation_id) is None
            assert queries.show_operation(conn, "globex", record.operation_id) is not None
        listed = {r.operation_id for r in queries.list_operations(conn, TENANT, limit=10_000)}
    assert listed.isdisjoint(r.operation_id for r in theirs)


def test_summary_counts_equal_the_fold(
    projected: tuple[Settings, list[Transition], Expected, str],
) -> None:
    settings, _events, expected, _ = projected
    tenants = ["acme", "globex", "initech"]
    with psycopg.connect(settings.dsn) as conn:
        result = queries.summary(conn, tenants)
        only_acme = queries.summary(conn, ["acme"])
    for tenant in tenants:
        want = Counter(r.state for r in expected.operations.values() if r.tenant_id == tenant)
        assert result.executions[tenant] == dict(want)
        want_del: Counter[tuple[str, DeliveryState]] = Counter(
            (d.destination, d.state) for d in expected.deliveries.values() if d.tenant_id == tenant
        )
        assert {k: v[0] for k, v in result.deliveries[tenant].items()} == dict(want_del)
        sends = sum(d.attempts for d in expected.deliveries.values() if d.tenant_id == tenant)
        assert sum(v[1] for v in result.deliveries[tenant].values()) == sends
        assert (tenant in result.oldest_unknown) == (ExecutionState.UNKNOWN in want)
    total_duplicates = sum(v == "duplicate" for v in expected.outcomes.values())
    assert sum(sum(d.values()) for d in result.duplicates.values()) == total_duplicates
    assert result.anomalies == {"acme": {"execution": 1}}
    assert set(only_acme.executions) == {"acme"}


def test_bad_arguments_are_refused_with_clear_errors(isolated: Settings) -> None:
    with psycopg.connect(isolated.dsn) as conn:
        with pytest.raises(queries.QueryError, match=r"not an execution state.*UNKNOWN"):
            queries.list_operations(conn, TENANT, state="LOST")
        with pytest.raises(queries.QueryError, match="not a tenant id"):
            queries.list_operations(conn, "acme; DROP TABLE x")
        with pytest.raises(queries.QueryError, match="limit"):
            queries.list_operations(conn, TENANT, limit=0)
        with pytest.raises(queries.QueryError, match="older_than"):
            queries.list_operations(conn, TENANT, older_than=timedelta(0))
        with pytest.raises(queries.QueryError, match="not an operation id"):
            queries.show_operation(conn, TENANT, "op_123")
        with pytest.raises(queries.QueryError, match="at least one tenant"):
            queries.summary(conn, [])


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env_for(settings, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_lists_and_shows_only_the_tenants_operations(
    projected: tuple[Settings, list[Transition], Expected, str],
) -> None:
    settings, _events, expected, _ = projected
    mine = _tenant_ops(expected, TENANT)
    unknown = [r.operation_id for r in mine if r.state is ExecutionState.UNKNOWN]

    listed = _cli(
        settings, "ops", "list", "--tenant", TENANT, "--state", "unknown", "--limit", "1000"
    )
    assert listed.returncode == 0, listed.stderr
    assert all(op in listed.stdout for op in unknown)
    assert f"{len(unknown)} operations" in listed.stdout
    assert not any(r.operation_id in listed.stdout for r in mine if r.operation_id not in unknown)

    shown = _cli(settings, "ops", "show", unknown[0], "--tenant", TENANT)
    assert shown.returncode == 0, shown.stderr
    assert unknown[0] in shown.stdout and "UNKNOWN" in shown.stdout

    theirs = next(r for r in expected.operations.values() if r.tenant_id == "globex")
    hidden = _cli(settings, "ops", "show", theirs.operation_id, "--tenant", TENANT)
    assert hidden.returncode == 2
    assert f"no operation {theirs.operation_id} for tenant {TENANT}" in hidden.stderr

    bad = _cli(settings, "ops", "list", "--tenant", TENANT, "--older-than", "5 minutes")
    assert bad.returncode == 2 and "not a duration" in bad.stderr


def test_cli_reports_a_database_that_is_down(isolated: Settings) -> None:
    down = isolated.with_(pg_dsn="postgresql://opledger@127.0.0.1:1/nothing")
    result = _cli(down, "ops", "list", "--tenant", TENANT)
    assert result.returncode == 2
    assert "cannot reach PostgreSQL" in result.stderr and "opledger stack up" in result.stderr

"""An analyst's role reads its own tenants' rows and nothing else, whatever SQL it writes.

Real roles on the stack's PostgreSQL: two analysts bound by ``opledger analysts add`` to
different tenants connect as themselves and try, by hand, what an analyst might (plain selects
on every projection, the documented views, joins, the tables of secrets, writes, their own
bindings, another role).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from uuid import uuid4

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from ledger.settings import Settings
from producers import TransitionRecorder
from tests.support import env_for, grant, project_in_process

PROJECTIONS = [
    "agent_operations",
    "deliveries",
    "operation_history",
    "anomalies",
    "reconciliations",
    "policy_grants",
    "revoked_credentials",
    "policy_history",
    "analyst.operations",
    "analyst.deliveries",
    "analyst.history",
    "analyst.reconciliations",
    "analyst.policy_grants",
]
#: What an analyst has no right to read at all.
OUT_OF_REACH = [
    "delivery_destinations",
    "results",
    "operation_leases",
    "operation_requests",
    "projector_offsets",
    "dead_letters",
]


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env_for(settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def roles(isolated: Settings) -> Iterator[list[str]]:
    """Role names of this test, dropped from the cluster afterwards."""
    made: list[str] = []
    yield made
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        for role in made:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _add(settings: Settings, roles: list[str], tenant: str) -> tuple[str, str]:
    role = f"analyst_{tenant}_{uuid4().hex[:8]}"
    done = _cli(settings, "analysts", "add", "--role", role, "--tenant", tenant)
    assert done.returncode == 0, done.stderr
    roles.append(role)
    match = re.search(
        r"password \(give it to the analyst; it is not shown again\): (\S+)", done.stdout
    )
    assert match, done.stdout
    return role, match.group(1)


def _as(settings: Settings, role: str, password: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        make_conninfo(settings.dsn, user=role, password=password), autocommit=True
    )


def _workload(settings: Settings) -> None:
    with TransitionRecorder.connect(settings) as recorder:
        for tenant in ("acme", "globex"):
            for n in range(3):
                op = recorder.intent(tenant, "agent-7", "send_email", {"n": n})
                recorder.dispatched(op, provider_ref=op.operation_id)
                recorder.succeeded(op, b"sent")
    grant(settings, "acme", tool="send_email")
    grant(settings, "globex", tool="wire_money")
    project_in_process(settings)


def test_a_tenants_analyst_reads_none_of_another_tenants_rows(
    isolated: Settings, roles: list[str]
) -> None:
    _workload(isolated)
    acme, acme_password = _add(isolated, roles, "acme")
    globex, globex_password = _add(isolated, roles, "globex")
    seen: dict[str, dict[str, set[str]]] = {}
    for role, password in ((acme, acme_password), (globex, globex_password)):
        with _as(isolated, role, password) as conn:
            seen[role] = {
                table: {row[0] for row in conn.execute(f"SELECT tenant_id FROM {table}")}
                for table in PROJECTIONS
            }
    for table in PROJECTIONS:
        assert seen[acme][table] <= {"acme"} and seen[globex][table] <= {"globex"}, table
    # The rows are there for their own tenant: the check sees something it could refuse.
    for table in ("agent_operations", "operation_history", "policy_grants", "analyst.operations"):
        assert seen[acme][table] == {"acme"} and seen[globex][table] == {"globex"}, table
    with psycopg.connect(isolated.dsn) as owner:
        assert owner.execute(
            "SELECT count(DISTINCT tenant_id) FROM agent_operations"
        ).fetchone() == (2,)


def test_hand_written_sql_cannot_reach_around_the_binding(
    isolated: Settings, roles: list[str]
) -> None:
    _workload(isolated)
    acme, password = _add(isolated, roles, "acme")
    with _as(isolated, acme, password) as conn:
        # Filters, joins and aggregates see the same rows as a plain select.
        assert conn.execute(
            "SELECT count(*) FROM agent_operations WHERE tenant_id = 'globex'"
        ).fetchone() == (0,)
        assert conn.execute(
            "SELECT count(*) FROM operation_history h JOIN agent_operations o USING (operation_id) "
            "WHERE h.tenant_id <> 'acme' OR o.tenant_id <> 'acme'"
        ).fetchone() == (0,)
        # Its own bindings only, and no way to add one.
        assert conn.execute("SELECT role_name, tenant_id FROM analyst_tenants").fetchall() == [
            (acme, "acme")
        ]
        for statement in (
            "INSERT INTO analyst_tenants (role_name, tenant_id, bound_by) "
            f"VALUES ('{acme}', 'globex', 'me')",
            "UPDATE analyst_tenants SET tenant_id = 'globex'",
            "UPDATE agent_operations SET error = 'x'",
            "DELETE FROM operation_history",
            "CREATE TABLE mine (x int)",
            "SET ROLE opledger",
            *(f"SELECT * FROM {table}" for table in OUT_OF_REACH),
        ):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)
        # A session setting is no binding.
        conn.execute("SET application_name = 'globex'")
        assert conn.execute("SELECT count(*) FROM agent_operations").fetchone() == (3,)


def test_a_role_bound_to_no_tenant_here_sees_no_row(isolated: Settings, roles: list[str]) -> None:
    _workload(isolated)
    acme, password = _add(isolated, roles, "acme")
    assert _cli(isolated, "analysts", "remove", "--role", acme).returncode == 0
    with _as(isolated, acme, password) as conn:
        for table in PROJECTIONS:
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table


def test_a_role_that_is_not_an_analysts_is_never_given_tenants(isolated: Settings) -> None:
    # The stack's own role is a superuser: row-level security would not hold it.
    with psycopg.connect(isolated.dsn) as conn:
        me = conn.execute("SELECT current_user").fetchone()
    assert me is not None
    done = _cli(isolated, "analysts", "add", "--role", str(me[0]), "--tenant", "acme")
    assert done.returncode == 2 and "is not an analyst's" in done.stderr, done.stderr
    assert _cli(isolated, "analysts", "list").stdout.startswith("no analyst")
